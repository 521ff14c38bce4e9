"""Imports run one way: no module of fxkfac, passes/ or planner/ reaches itself again through its imports, counting
imports behind TYPE_CHECKING and inside functions (a cycle hidden there is still a cycle of the design)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"fxkfac": "fxkfac", "passes": "fxkfac.passes", "planner": "fxkfac.planner"}
"""Source folder -> the package it is installed as (pyproject.toml's package-dir)."""


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _imports(module: str, path: Path, known: Mapping[str, Path]) -> Iterator[str]:
    """The known modules `module` imports anywhere in its file (a package's own submodules excepted for its
    __init__, which re-exports them)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            if target in known and target != module and not target.startswith(module + "."):
                yield target


def _cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back() -> None:
    known = _modules()
    edges = {m: set(_imports(m, p, known)) for m, p in known.items()}
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_passes_and_planner_never_import_the_front() -> None:
    known = _modules()
    for module, path in known.items():
        if module.startswith(("fxkfac.passes", "fxkfac.planner")):
            front = {
                m
                for m in _imports(module, path, known)
                if not m.startswith(("fxkfac.passes", "fxkfac.planner")) and m != "fxkfac"
            }
            assert not front, f"{module} imports the front/runtime: {sorted(front)}"


PLANNER_LAYERS = {
    "problem": set(),
    "plan": {"problem"},
    "validate": {"problem", "plan"},
    "search": {"problem", "plan"},
}
"""planner/'s sub-packages, each with the ones it may import: the problem and its costs at the bottom, the plan
(its window, solutions, the Plan) on it, then the search and, beside it, the validator, which never sees the
search. The package's own __init__ (the front door) may import any."""


def _planner_layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["fxkfac", "planner"] else None


def test_planner_sub_packages_import_one_way() -> None:
    known = _modules()
    layers = {_planner_layer(m) for m in known} - {None}
    assert layers == set(PLANNER_LAYERS), f"planner/ holds {sorted(layers)}, not {sorted(PLANNER_LAYERS)}"
    for module, path in known.items():
        layer = _planner_layer(module)
        if layer is None:
            continue
        for target in _imports(module, path, known):
            other = _planner_layer(target)
            if target == "fxkfac.planner" or (other is not None and other != layer):
                assert other in PLANNER_LAYERS[layer], f"{module} ({layer}) imports {target} ({other})"


def test_the_layer_rule_reads_a_module_layer() -> None:
    assert _planner_layer("fxkfac.planner.search.cpsat") == "search"
    assert _planner_layer("fxkfac.planner") is None


def test_the_planner_front_door_loads_neither_sympy_nor_ortools() -> None:
    """The sub-packages' `__init__` export only what loads without them: the analytic model and CP-SAT load when
    used (and `fxkfac plan` runs without torch)."""
    code = (
        "import sys, fxkfac.planner, fxkfac.planner.problem, fxkfac.planner.plan, fxkfac.planner.search, "
        "fxkfac.planner.validate; heavy = {'sympy', 'ortools', 'torch'} & set(sys.modules); "
        "assert not heavy, f'loaded {heavy}'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
