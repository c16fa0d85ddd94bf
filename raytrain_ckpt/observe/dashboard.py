"""The Grafana dashboard, put where the Grafana that Ray documents already looks.

Ray writes its own dashboards into ``<session dir>/metrics/grafana/dashboards/`` and a
Grafana provisioning file that loads every dashboard in that directory (Grafana started with
``--config <session dir>/metrics/grafana/grafana.ini``, as Ray's metrics guide shows). Putting
``raytrain_ckpt``'s dashboard there when a job starts makes it appear beside Ray's, with no
import step. The JSON ships in the package (``raytrain_ckpt/observe/grafana/``); ``cluster/`` keeps
the same file for importing it by hand into any other Grafana.
"""

from __future__ import annotations

import logging
import shutil
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["DASHBOARD_FILE", "dashboards_dir", "install_dashboard", "packaged_dashboard"]

DASHBOARD_FILE = "raytrain_ckpt_grafana_dashboard.json"
"""The file's name in Ray's dashboards directory (Ray's own are ``<name>_grafana_dashboard.json``)."""
SESSION_LATEST = Path("/tmp/ray/session_latest")
"""Ray's documented link to the newest session directory on a node."""


def packaged_dashboard() -> Path:
    """The dashboard JSON shipped with the package."""
    return Path(str(resources.files("raytrain_ckpt") / "observe" / "grafana" / "grafana_dashboard.json"))


def dashboards_dir() -> Path | None:
    """Ray's Grafana dashboards directory of the session this process is connected to, on this
    node; None when this process runs no Ray node of its own (a Ray Client connection)."""
    try:
        from ray._private import worker

        node = worker._global_node
    except (ImportError, AttributeError):  # the private attribute moved: use the documented path
        return SESSION_LATEST / "metrics" / "grafana" / "dashboards"
    if node is None:
        return None
    return Path(node.get_session_dir_path()) / "metrics" / "grafana" / "dashboards"


def install_dashboard(target: Path | None = None) -> Path | None:
    """Copy the dashboard into ``target`` (default: ``dashboards_dir()``); returns the file written.

    Best effort: a job runs the same without it, so a failure is a warning, never an error.
    """
    target = target or dashboards_dir()
    if target is None:
        return None
    try:
        target.mkdir(parents=True, exist_ok=True)
        out = target / DASHBOARD_FILE
        shutil.copyfile(packaged_dashboard(), out)
    except OSError as exc:  # a read-only or foreign session directory: the dashboard can still be imported by hand
        logger.warning("could not add the Grafana dashboard to %s (%s); import cluster/grafana_dashboard.json "
                       "by hand", target, exc)
        return None
    logger.info("Grafana dashboard 'raytrain_ckpt' in %s", out)
    return out
