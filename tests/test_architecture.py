"""The dependency rules of docs/architecture.md, checked on the import graph.

* The leaves (`loss`, `data_worker`, `router`) import nothing from `slime_async`.
* Inside `slime_async`, the components (trainer, engine, rollout, weights, metrics) import only
  the contracts (`slime_async.contracts`), the host helpers (`slime_async.host`), the start-up
  log (`slime_async.startup`; both import nothing from slime_async) and themselves.
* Two wings above the components: the config wing (`slime_async.config`: parse, derive, check)
  imports nothing of the orchestrator wing (`slime_async.orchestrator`: the live run); the
  components import neither wing. The package root holds at most 8 modules.
* The stability lab (`lab`, a repository tool, not installed) may import the runtime; the
  runtime (`slime_async` and the leaves) never imports it.
* No import cycle among the project's modules, `TYPE_CHECKING` imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("slime_async", "loss", "data_worker", "router")
LEAVES = ("loss", "data_worker", "router")
TOOLS = ("lab",)
COMPONENTS = ("trainer", "engine", "rollout", "weights", "metrics")
SHARED = ("contracts", "host", "startup")
CONFIG_WING, ORCHESTRATOR_WING = "slime_async.config", "slime_async.orchestrator"


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in (*PACKAGES, *TOOLS):
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules `name` imports anywhere in its file (functions and TYPE_CHECKING too)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def test_leaves_never_import_the_orchestrator():
    bad = [
        (m, d)
        for m, deps in _graph().items()
        if m.split(".")[0] in LEAVES
        for d in deps
        if d.split(".")[0] == "slime_async"
    ]
    assert not bad, f"leaf modules importing slime_async: {bad}"


def test_the_runtime_never_imports_the_lab_tools():
    graph = _graph()
    assert any(m.split(".")[0] in TOOLS for m in graph), "the lab package was not found"
    bad = [
        (m, d)
        for m, deps in graph.items()
        if m.split(".")[0] in PACKAGES
        for d in deps
        if d.split(".")[0] in TOOLS
    ]
    assert not bad, f"runtime modules importing the lab tools: {bad}"


def test_components_meet_only_through_the_contracts():
    bad = []
    for m, deps in _graph().items():
        parts = m.split(".")
        if parts[0] != "slime_async" or len(parts) < 2 or parts[1] not in COMPONENTS:
            continue
        for d in deps:
            dp = d.split(".")
            if dp[0] == "slime_async" and len(dp) > 1 and dp[1] not in (parts[1], *SHARED):
                bad.append((m, d))
    assert not bad, f"a component imports another component's internals: {bad}"


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_config_wing_never_imports_the_orchestrator():
    bad = [
        (m, d)
        for m, deps in _graph().items()
        if _in(m, CONFIG_WING)
        for d in deps
        if _in(d, ORCHESTRATOR_WING)
    ]
    assert not bad, f"config modules importing the live run: {bad}"


def test_components_import_neither_wing():
    bad = [
        (m, d)
        for m, deps in _graph().items()
        if m.split(".")[0] in LEAVES
        or (m.startswith("slime_async.") and m.split(".")[1] in (*COMPONENTS, *SHARED))
        for d in deps
        if _in(d, CONFIG_WING) or _in(d, ORCHESTRATOR_WING)
    ]
    assert not bad, f"components importing a wing: {bad}"


def test_the_package_root_stays_small():
    root = sorted(p.name for p in (ROOT / "slime_async").glob("*.py"))
    assert len(root) <= 8, f"slime_async/ holds {len(root)} modules (at most 8): {root}"


def test_no_import_cycles():
    graph = _graph()
    # a package importing its own submodules (re-exports in __init__) is not a cycle of design
    for m, deps in graph.items():
        graph[m] = {d for d in deps if not d.startswith(m + ".") and not m.startswith(d + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"
