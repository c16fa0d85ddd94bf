"""What ``checkpoint_stall.py`` checks its figures against: the targets of the save path, and the
figures the README records (``bench/recorded/checkpoint_stall.json``, written by ``--record``).

Printed after the table, one line per figure: its value in this run, the target (PASS / MISS),
and the recorded figure with the change (REGRESSION when it is worse by more than the run-to-run
noise of this kind of machine, ``TOLERANCE``). Every figure is a ratio against a peer or a
floor measured in the same run, or a time per save, so the comparison across runs holds as far
as the machine's load does: the load average is printed beside it. Nothing here fails a test:
speed is measured, not asserted.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

RECORDED = Path(__file__).resolve().parent / "recorded" / "checkpoint_stall.json"
"""The local-disk run's recorded figures; an object-store run's are ``checkpoint_stall-object-store.json``."""

TOLERANCE = 1.5
"""A figure this many times worse than recorded is flagged: two runs on this 2-core machine differ
by up to about 1.3x on the ratios (README, two runs each)."""

# figure name -> (what it is, target, lower is better)
TARGETS: dict[str, tuple[str, float, bool]] = {
    "lost_vs_async": ("training time lost per save / best dcp.async_save mode's", 0.3, True),
    "tput_vs_dcp_save": ("durable throughput / sync dcp.save's (both against the raw floor)", 1.0, False),
    "writer_cpu_s_per_gb": ("writer CPU s/GB", 2.0, True),
    "stall_per_memcpy": ("stall per save / memcpy of the state", 0.3, True),
    "first_stall_s": ("first save of an attempt: stall s", 0.1, True),
}


def figures(costs: dict[str, dict[str, float]], mode: str = "raytrain_ckpt") -> dict[str, float]:
    """The save path's figures of ``mode`` from the run's rows (modes missing: figures missing)."""
    out: dict[str, float] = {}
    ours = costs.get(mode)
    if ours is None:
        return out
    peers = [costs[m]["lost_s"] for m in ("dcp.async_save(thread)", "dcp.async_save(process)") if m in costs]
    if peers and min(peers) > 0:
        out["lost_vs_async"] = ours["lost_s"] / min(peers)
    if "dcp.save" in costs and costs["dcp.save"]["tput_per_raw"] > 0:
        out["tput_vs_dcp_save"] = ours["tput_per_raw"] / costs["dcp.save"]["tput_per_raw"]
    for key in ("writer_cpu_s_per_gb", "stall_per_memcpy", "first_stall_s"):
        if key in ours:
            out[key] = ours[key]
    return out


def report(found: dict[str, float], record: bool = False, object_store: bool = False) -> list[str]:
    """Lines comparing ``found`` with the targets and the recorded figures of the same kind of
    destination; ``record``: write them as the new recorded figures (after a change whose figures
    the README then shows)."""
    path = RECORDED.with_name("checkpoint_stall-object-store.json") if object_store else RECORDED
    recorded = _load(path)
    load = os.getloadavg()[0]
    lines = [f"against the targets and the recorded figures ({path.name}, "
             f"load then {recorded.get('load_1m', float('nan')):.1f}; now {load:.1f}):"]
    for key, (what, target, lower) in TARGETS.items():
        if key not in found:
            continue
        value = found[key]
        ok = value <= target if lower else value >= target
        line = f"  {what}: {value:.3f} (target {'<=' if lower else '>='} {target}: {'PASS' if ok else 'MISS'})"
        before = recorded.get("figures", {}).get(key)
        if isinstance(before, (int, float)) and before > 0 and math.isfinite(value):
            worse = value / before if lower else before / max(value, 1e-12)
            flag = "  REGRESSION" if worse > TOLERANCE else ""
            line += f"; recorded {before:.3f} ({value / before:.2f}x){flag}"
        lines.append(line)
    if record:
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"load_1m": round(load, 2), "figures": {k: round(v, 4) for k, v in found.items()}},
                                       indent=1) + "\n")
        lines.append(f"  recorded in {path}")
    return lines


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
