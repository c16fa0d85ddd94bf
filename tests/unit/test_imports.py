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
    assert "raytrain_ckpt.trainer" in graph["raytrain_ckpt.worker"]       # imported inside _setup()
    assert "raytrain_ckpt.controller" not in graph["raytrain_ckpt.metrics"]  # annotations only


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


LIGHT = [
    # what the controller's unit tests import, and the CLI's offline commands
    (["raytrain_ckpt.controller", "raytrain_ckpt.events", "raytrain_ckpt.spec", "raytrain_ckpt.metrics",
      "tests.unit.test_controller"], ("torch", "ray")),
    (["raytrain_ckpt", "raytrain_ckpt.api", "raytrain_ckpt.cli", "raytrain_ckpt.inventory"], ("torch", "ray")),
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
    code = ("from raytrain_ckpt.cli import main\n"
            "assert main(['validate', 'jobs/llama_debug_fsdp.yaml', '--set', 'model.overrides.n_layers=6']) == 0")
    assert _loaded_after(code, ("torch", "ray", "numpy")) == []


@pytest.mark.parametrize("argv", [["import", "/dev/null", "--to", "{tmp}/out"],
                                  ["export", "{tmp}", "--format", "torch", "--out", "/dev/null"]])
def test_export_and_import_refuse_a_bad_path_before_importing_torch(tmp_path, argv):
    args = [a.format(tmp=tmp_path) for a in argv]
    code = f"from raytrain_ckpt.cli import main\nassert main({args!r}) == 2"
    assert _loaded_after(code, ("torch", "ray")) == []


def test_validate_of_a_gpu_spec_imports_torch_only_where_a_gpu_driver_is():
    from raytrain_ckpt.preflight import _has_gpu_device_files

    # torch.cuda tells the GPU's memory; a driver machine without a GPU skips that check
    code = "from raytrain_ckpt.cli import main\nassert main(['validate', 'jobs/llama_8b_gpu.yaml']) == 0"
    assert _loaded_after(code, ("torch", "ray")) == (["torch"] if _has_gpu_device_files() else [])
