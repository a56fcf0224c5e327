"""The tree shows the planes: no import cycles, the core and the execution plane never reach up into
the control plane or the frontend, modules stay small, core functions stay short, and routing is
decided in exactly one place (the dispatch path). Pure AST reads of ``src/thunderagent``."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "thunderagent"

CORE = ("thunderagent.kv", "thunderagent.router", "thunderagent.scheduler", "thunderagent.engine")
EXECUTION = ("thunderagent.execution",)
UPPER = ("thunderagent.control", "thunderagent.frontend", "thunderagent.cli", "thunderagent.sim",
         "thunderagent.observe", "thunderagent.assemble", "thunderagent.overrides")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


MODS = _modules()
TREES = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in MODS.items()}


def _imports(mod: str, tree: ast.Module) -> set[str]:
    out: set[str] = set()
    is_pkg = MODS[mod].name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = mod.split(".")[: len(mod.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join([*parts, base] if base else parts)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        out.update(n for n in names if n in MODS and n != mod)
    return out


GRAPH = {m: _imports(m, t) for m, t in TREES.items()}


def test_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in GRAPH:
        if m not in index:
            visit(m)
    assert cycles == []


def test_layering() -> None:
    bad = defaultdict(list)
    for m, targets in GRAPH.items():
        if m.startswith(CORE):
            forbidden = (*UPPER, *EXECUTION, "thunderagent.bus")
        elif m.startswith(EXECUTION):
            forbidden = UPPER
        else:
            continue
        bad[m] += [t for t in targets if t.startswith(forbidden)]
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_modules_stay_under_500_lines() -> None:
    big = {m: n for m, p in MODS.items() if (n := p.read_text(encoding="utf-8").count("\n")) > 500}
    assert big == {}


def test_core_functions_stay_short() -> None:
    long = {}
    for m, tree in TREES.items():
        if not m.startswith((*CORE, *EXECUTION, "thunderagent.control")):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > 60:
                    long[f"{m}.{node.name}"] = n
    assert long == {}


def test_routing_is_decided_in_one_place() -> None:
    calls = [
        f"{m}:{node.lineno}"
        for m, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "route"
    ]
    assert len(calls) == 1 and calls[0].startswith("thunderagent.scheduler.dispatch:"), calls


def test_the_checker_sees_the_tree() -> None:
    # guards against the checks above passing vacuously
    assert len(MODS) > 40 and "thunderagent.control.fleet" in GRAPH["thunderagent.frontend.app"]
