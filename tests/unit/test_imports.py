"""Layering: no import cycles among raytrain_ckpt's modules, and the light modules stay light.

The cycle check counts imports inside functions too: a function-level import still makes one
module depend on the other (it only defers when the import runs), and a cycle hidden that
way is the same tangle. Imports under ``if TYPE_CHECKING:`` are for annotations only and are
ignored.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "raytrain_ckpt"


def _module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The raytrain_ckpt modules ``path`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {owner(a.name) for a in node.names if a.name.startswith("raytrain_ckpt")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("raytrain_ckpt"):
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else owner(node.module)
                      for a in node.names}
    return {m for m in found if m is not None}


def import_graph() -> dict[str, set[str]]:
    modules = _module_names()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None


def test_the_graph_sees_function_level_imports_and_skips_type_checking():
    graph = import_graph()
    assert "raytrain_ckpt.rank.trainer" in graph["raytrain_ckpt.rank.worker"]       # imported inside _setup()
    assert "raytrain_ckpt.control.controller" not in graph["raytrain_ckpt.control.metrics"]  # annotations only


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


LIGHT = [
    # what the controller's unit tests import, and the CLI's offline commands
    (["raytrain_ckpt.control.controller", "raytrain_ckpt.common.events", "raytrain_ckpt.spec", "raytrain_ckpt.observe.metrics",
      "raytrain_ckpt.control.metrics",
      "tests.unit.test_controller"], ("torch", "ray")),
    (["raytrain_ckpt", "raytrain_ckpt.api", "raytrain_ckpt.cli.main", "raytrain_ckpt.report.inventory"], ("torch", "ray")),
]


def _loaded_after(code: str, watched: tuple[str, ...]) -> list[str]:
    """Which of ``watched`` a fresh interpreter has imported after running ``code``."""
    code += f"\nimport json, sys\nprint(json.dumps([m for m in {list(watched)!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("modules", "absent"), LIGHT)
def test_light_modules_import_neither_torch_nor_ray(modules, absent):
    assert _loaded_after("".join(f"import {m}\n" for m in modules), absent) == []


def test_validate_of_a_built_in_model_imports_neither_torch_nor_ray():
    # the whole command: parser, spec loading, and the environment checks, whose memory check
    # sizes the built-in model from its config; the demo spec trains on CPU
    code = ("from raytrain_ckpt.cli.main import main\n"
            "assert main(['validate', 'jobs/llama_debug_fsdp.yaml', '--set', 'model.overrides.n_layers=6']) == 0")
    assert _loaded_after(code, ("torch", "ray", "numpy")) == []


@pytest.mark.parametrize("argv", [["import", "/dev/null", "--to", "{tmp}/out"],
                                  ["export", "{tmp}", "--format", "torch", "--out", "/dev/null"]])
def test_export_and_import_refuse_a_bad_path_before_importing_torch(tmp_path, argv):
    args = [a.format(tmp=tmp_path) for a in argv]
    code = f"from raytrain_ckpt.cli.main import main\nassert main({args!r}) == 2"
    assert _loaded_after(code, ("torch", "ray")) == []


def test_validate_of_a_gpu_spec_imports_torch_only_where_a_gpu_driver_is():
    from raytrain_ckpt.control.preflight import _has_gpu_device_files

    # torch.cuda tells the GPU's memory; a driver machine without a GPU skips that check
    code = "from raytrain_ckpt.cli.main import main\nassert main(['validate', 'jobs/llama_8b_gpu.yaml']) == 0"
    assert _loaded_after(code, ("torch", "ray")) == (["torch"] if _has_gpu_device_files() else [])


# --- the rooms of checkpoint/ -----------------------------------------------------------------

ROOMS: dict[str, set[str]] = {
    # room -> the rooms it may import (besides itself, records and errors)
    "format": set(),
    "storage": {"format"},
    "policy": {"format"},
    "datapath": {"format", "storage"},
    "recovery": {"format", "storage", "policy", "datapath"},
    "interchange": {"format", "storage", "policy"},
    "roles": {"format", "storage", "policy", "datapath", "recovery", "interchange"},
}
SHARED = {"records", "errors"}
"""Top-level modules of checkpoint/ that every room may import: plain data and error types."""


def room_of(module: str) -> str | None:
    """``raytrain_ckpt.checkpoint.storage.layout`` -> ``storage``; None outside checkpoint's rooms."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["raytrain_ckpt", "checkpoint"] else None


def room_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import across rooms that the ROOMS table does not allow."""
    out = []
    for module, deps in sorted(graph.items()):
        room = room_of(module)
        if room is None:
            continue
        for dep in sorted(deps):
            target = room_of(dep)
            if target is None:
                if dep == "raytrain_ckpt.checkpoint":
                    out.append(f"{module} -> {dep}")
                continue
            if room in SHARED and target not in SHARED:
                out.append(f"{module} -> {dep}")
            elif target != room and target not in SHARED and target not in ROOMS.get(room, set()):
                out.append(f"{module} -> {dep}")
    return out


def test_the_room_check_finds_a_forbidden_import_and_allows_the_table():
    graph = {"raytrain_ckpt.checkpoint.format.manifest": {"raytrain_ckpt.checkpoint.storage.layout"},
             "raytrain_ckpt.checkpoint.roles.writer": {"raytrain_ckpt.checkpoint.datapath.staging",
                                                       "raytrain_ckpt.checkpoint.records"},
             "raytrain_ckpt.checkpoint.policy.retention": {"raytrain_ckpt.checkpoint.format.names",
                                                           "raytrain_ckpt.checkpoint.roles.actor"},
             "raytrain_ckpt.checkpoint.records": {"raytrain_ckpt.checkpoint.format.manifest"}}
    assert room_violations(graph) == [
        "raytrain_ckpt.checkpoint.format.manifest -> raytrain_ckpt.checkpoint.storage.layout",
        "raytrain_ckpt.checkpoint.policy.retention -> raytrain_ckpt.checkpoint.roles.actor",
        "raytrain_ckpt.checkpoint.records -> raytrain_ckpt.checkpoint.format.manifest",
    ]


def test_every_module_of_checkpoint_lives_in_a_room():
    loose = sorted(m for m in import_graph() if room_of(m) is not None and room_of(m) not in ROOMS
                   and room_of(m) not in SHARED)
    assert loose == [], "a checkpoint module outside the rooms of ROOMS"


def test_each_room_imports_only_what_the_table_allows():
    assert room_violations(import_graph()) == []


def _imports_ray(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        if any(n == "ray" or n.startswith("ray.") for n in names):
            return True
    return False


def test_only_roles_imports_ray():
    outside = sorted(name for name, path in _module_names().items()
                     if room_of(name) not in (None, "roles") and _imports_ray(path))
    assert outside == [], "only checkpoint/roles/ talks to Ray"


def test_spec_imports_nothing_of_checkpoint():
    graph = import_graph()
    spec = {m: sorted(d for d in deps if d.startswith("raytrain_ckpt.checkpoint"))
            for m, deps in graph.items() if m == "raytrain_ckpt.spec" or m.startswith("raytrain_ckpt.spec.")}
    assert {m: d for m, d in spec.items() if d} == {}


def test_the_ray_check_sees_an_import_in_a_function(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    import ray.util\n")
    assert _imports_ray(f)
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ray\nimport raytrain_ckpt\n")
    assert not _imports_ray(f)


MAX_CLASS_LINES, MAX_MODULE_LINES = 250, 500
"""A class past 250 lines holds more than one concern; a module past 500 becomes a package."""


def oversized(root: Path) -> list[str]:
    """``path: N lines`` for every module over MAX_MODULE_LINES and ``path:Class: N lines`` for
    every class over MAX_CLASS_LINES below ``root``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(root).as_posix()
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            out.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                out.append(f"{name}:{node.name}: {n} lines")
    return out


def test_the_size_check_counts_classes_and_modules(tmp_path):
    (tmp_path / "a.py").write_text("class A:\n" + "    x = 1\n" * MAX_CLASS_LINES + "y = 2\n")
    (tmp_path / "b.py").write_text("z = 0\n" * (MAX_MODULE_LINES + 1))
    assert oversized(tmp_path) == [f"a.py:A: {MAX_CLASS_LINES + 1} lines", f"b.py: {MAX_MODULE_LINES + 1} lines"]


def test_no_class_or_module_of_checkpoint_is_oversized():
    assert oversized(PACKAGE / "checkpoint") == []


def test_no_class_or_module_of_the_package_is_oversized():
    assert oversized(PACKAGE) == [], "split it along its seams: a class past 250 lines, a module past 500"


# --- the rooms of the package -----------------------------------------------------------------

MAX_TOP_LEVEL = 4
"""Modules directly in raytrain_ckpt/: ``__init__``, ``__main__`` and ``api``; the rest lives in rooms."""

PACKAGE_ROOMS: dict[str, set[str]] = {
    # room -> the rooms it may import (besides itself and SHARED_MODULES); by the process that
    # runs it, leaves first. Two rooms never import each other: the table is a layering.
    "common": set(),
    "replicas": set(),  # torchft's quorum and heal; optional, imported only by a job with replicas
    "models": {"common"},
    "data": {"common", "models"},
    "spec": {"common", "models", "data"},
    "parallel": {"common", "models", "spec"},
    "observe": {"common", "models", "spec"},
    "checkpoint": {"common", "models", "data", "spec", "parallel", "observe"},
    "report": {"common", "spec", "checkpoint"},
    "rank": {"common", "models", "data", "spec", "parallel", "observe", "checkpoint", "replicas"},
    "control": {"common", "models", "data", "spec", "parallel", "observe", "checkpoint", "report", "rank", "replicas"},
    "api": {"common", "spec", "control", "report"},
    "cli": {"common", "models", "data", "spec", "parallel", "observe", "checkpoint", "report", "rank", "control",
            "api"},
    "__main__": {"cli"},
}
SHARED_MODULES = {"raytrain_ckpt.checkpoint.records", "raytrain_ckpt.checkpoint.errors"}
"""Plain data and error types that import nothing of the package: every room may import them."""


def package_room(module: str) -> str | None:
    """``raytrain_ckpt.control.watch.hangs`` -> ``control``; ``raytrain_ckpt.api`` -> ``api``; the
    package itself (whose attributes are imported lazily) -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def package_room_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import across the package's rooms that PACKAGE_ROOMS does not allow."""
    out = []
    for module, deps in sorted(graph.items()):
        room = package_room(module)
        for dep in sorted(deps - SHARED_MODULES):
            target = package_room(dep)
            if room is not None and target != room and target not in PACKAGE_ROOMS.get(room, set()):
                out.append(f"{module} -> {dep}")
    return out


def test_the_package_room_check_finds_a_forbidden_import_and_allows_the_table():
    graph = {"raytrain_ckpt.rank.worker": {"raytrain_ckpt.control.watch.hangs", "raytrain_ckpt.observe.metrics",
                                           "raytrain_ckpt.rank.guard"},
             "raytrain_ckpt.models.hf": {"raytrain_ckpt.checkpoint.errors"},
             "raytrain_ckpt.common.logs": {"raytrain_ckpt.spec"}}
    assert package_room_violations(graph) == ["raytrain_ckpt.common.logs -> raytrain_ckpt.spec",
                                              "raytrain_ckpt.rank.worker -> raytrain_ckpt.control.watch.hangs"]


def test_the_package_rooms_form_layers():
    mutual = sorted(f"{a} <-> {b}" for a, allowed in PACKAGE_ROOMS.items() for b in allowed
                    if a < b and a in PACKAGE_ROOMS.get(b, set()))
    assert mutual == []


def test_every_module_of_the_package_lives_in_a_room():
    rooms = {package_room(m) for m in import_graph()} - {None}
    assert sorted(rooms - set(PACKAGE_ROOMS)) == [], "a module outside the rooms of PACKAGE_ROOMS"
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"modules directly in raytrain_ckpt/: {top}"


def test_each_package_room_imports_only_what_the_table_allows():
    assert package_room_violations(import_graph()) == []


# --- who speaks Ray to other processes ----------------------------------------------------------

RAY_CALLERS: dict[str, bool] = {
    # room (checkpoint/ by its own rooms) -> whether its code calls Ray: a remote method or task
    # (``x.remote(...)``) or an actor or task of its own (``ray.remote``). Per process, one room
    # speaks Ray to the others: the driver through control/, a rank and the CLI to the checkpoint
    # processes through checkpoint/roles/ (``client.py``, ``client_asks.py``), the checkpoint
    # processes to each other through checkpoint/roles/.
    "control": True,  # the driver: its ranks (start, poll, preempt, evidence), spares, node probes
    "checkpoint/roles": True,  # the CheckpointActor, the writers, and the ranks' and the CLI's clients of them
    "replicas": True,  # the Lighthouse actor on the head node: its own room, an optional extra importing nothing
    "checkpoint/format": False, "checkpoint/storage": False, "checkpoint/policy": False,
    "checkpoint/datapath": False, "checkpoint/recovery": False, "checkpoint/interchange": False,
    "checkpoint/records": False, "checkpoint/errors": False, "checkpoint": False,
    "rank": False, "report": False, "observe": False, "cli": False, "api": False, "__main__": False,
    "common": False, "models": False, "data": False, "spec": False, "parallel": False,
}


def ray_room(module: str) -> str:
    """``raytrain_ckpt.checkpoint.roles.client`` -> ``checkpoint/roles``; ``raytrain_ckpt.rank.resume``
    -> ``rank``; the package itself -> ``api`` (its lazy names are the API's)."""
    checkpoint = room_of(module)
    if checkpoint is not None:
        return f"checkpoint/{checkpoint}"
    return package_room(module) or "api"


def calls_ray(path: Path) -> list[int]:
    """The lines of ``path`` that call Ray's remote API (``.remote``), outside ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    return sorted({node.lineno for node in ast.walk(tree)
                   if id(node) not in skip and isinstance(node, ast.Attribute) and node.attr == "remote"})


def ray_call_violations(modules: dict[str, Path]) -> list[str]:
    """``module:line`` for every call of Ray's remote API in a room RAY_CALLERS does not allow."""
    return [f"{name}:{line}" for name, path in sorted(modules.items()) if not RAY_CALLERS.get(ray_room(name), False)
            for line in calls_ray(path)]


def test_the_ray_call_check_finds_a_call_a_decorator_and_allows_the_table(tmp_path):
    (tmp_path / "a.py").write_text("def f(actor):\n    return actor.status.remote()\n")
    (tmp_path / "b.py").write_text("import ray\n\n@ray.remote\ndef g():\n    pass\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    x = y.remote\n")
    modules = {"raytrain_ckpt.rank.a": tmp_path / "a.py", "raytrain_ckpt.report.b": tmp_path / "b.py",
               "raytrain_ckpt.rank.c": tmp_path / "c.py", "raytrain_ckpt.checkpoint.roles.a": tmp_path / "a.py",
               "raytrain_ckpt.control.b": tmp_path / "b.py"}
    assert ray_call_violations(modules) == ["raytrain_ckpt.rank.a:2", "raytrain_ckpt.report.b:3"]


def test_every_room_has_a_row_in_the_ray_table():
    assert sorted({ray_room(m) for m in _module_names()} - set(RAY_CALLERS)) == []


def test_only_the_rooms_of_the_table_call_ray():
    assert ray_call_violations(_module_names()) == [], "call Ray through the room that speaks it for this process"
