"""The package's import layers: which top-level parts of ``pdd`` import which.

A unit is a top-level subpackage or module of ``src/pdd`` (``bench``, ``sim``, ``gateway``,
``transfer``, ``config``, ``cli`` ...). Every ``import`` / ``from ... import`` statement anywhere
in a unit's files is an arrow to the unit it names, lazy imports inside functions and
``TYPE_CHECKING`` imports included (read with ``ast``, nothing is imported). The tests:

- no cycle between units (an arrow that runs back up makes two layers one);
- ``policy`` imports nothing of pdd but ``policy`` and ``types`` (pure decisions, shared by the
  runtime and the simulator);
- the package map of ``docs/ARCHITECTURE.md`` lists every unit, each below every unit it imports.

Run it as a script to print the graph's cycles with the statements that make them::

    python tests/test_import_layers.py [src]
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
# the layers the tests name first when one of them is in a cycle
GUARDED = ("config", "topology", "bench", "sim", "cli", "cli_args", "workload", "step_profile")
POLICY_MAY_IMPORT = {"policy", "types"}


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imported(node: ast.AST, package: str) -> list[str]:
    """Absolute dotted names an import statement may refer to (a ``from`` import's names may be
    modules of the package it names, so each is listed too)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        return [mod] + [f"{mod}.{a.name}" for a in node.names]
    return []


def import_edges(src: Path = SRC) -> dict[tuple[str, str], list[str]]:
    """``{(unit, imported unit): ["pdd/path.py:line module", ...]}`` over every ``.py`` file of
    ``src/pdd``: one entry per import statement (a ``from`` import's names that are modules of a
    unit count for that unit)."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted((src / "pdd").rglob("*.py")):
        mod = _module_name(path, src)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        unit = mod.split(".")[1] if "." in mod else "pdd"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = _imported(node, package)
            for target in dict.fromkeys(n.split(".")[1] for n in names if n.startswith("pdd.")):
                is_unit = (src / "pdd" / f"{target}.py").is_file() or (src / "pdd" / target).is_dir()
                if is_unit and target != unit:
                    edges[(unit, target)].append(f"{path.relative_to(src)}:{node.lineno} {names[0]}")
    return dict(edges)


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan), each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for u, v in edges:
        graph[u].add(v)
        graph.setdefault(v, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def describe(comp: list[str], edges: dict[tuple[str, str], list[str]]) -> str:
    lines = [f"cycle: {' / '.join(comp)}"]
    for (u, v), where in sorted(edges.items()):
        if u in comp and v in comp:
            more = f" (+{len(where) - 1} more)" if len(where) > 1 else ""
            lines.append(f"  {u} -> {v}: {where[0]}{more}")
    return "\n".join(lines)


def test_the_guarded_layers_are_in_no_cycle():
    edges = import_edges()
    bad = [c for c in cycles(edges) if set(c) & set(GUARDED)]
    assert not bad, "\n".join(describe(c, edges) for c in bad)


def test_no_cycle_between_any_units():
    edges = import_edges()
    found = cycles(edges)
    assert not found, "\n".join(describe(c, edges) for c in found)


def test_policy_imports_only_policy_and_types():
    edges = import_edges()
    bad = {v: where for (u, v), where in edges.items() if u == "policy" and v not in POLICY_MAY_IMPORT}
    assert not bad, bad


def package_map(doc: Path = SRC.parent / "docs" / "ARCHITECTURE.md") -> list[str]:
    """The units of the "Package map" table, in its order (```bench/``` -> ``bench``)."""
    text = doc.read_text()
    table = text[text.index("## Package map"):]
    table = table[: table.index("\n## ", 1)]
    out = []
    for line in table.splitlines():
        if line.startswith("| `"):
            name = line.split("`")[1]
            out.append(name.removesuffix(".py").removesuffix("/"))
    return out


def test_the_architecture_package_map_lists_each_unit_below_what_it_imports():
    edges = import_edges()
    order = package_map()
    units = {p.stem for p in (SRC / "pdd").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and any(p.glob("*.py")))}
    missing = sorted(units - set(order))
    assert not missing, f"missing from docs/ARCHITECTURE.md's package map: {missing}"
    pos = {u: i for i, u in enumerate(order)}
    upward = [f"{u} -> {v}: {where[0]}" for (u, v), where in sorted(edges.items())
              if u in pos and v in pos and pos[v] > pos[u]]
    assert not upward, "listed above what they import in docs/ARCHITECTURE.md:\n" + "\n".join(upward)


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function and a relative import are arrows, and a
    cycle made of them is reported with its statements."""
    pkg = tmp_path / "pdd"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from .x import f\n")
    (pkg / "a" / "x.py").write_text("def f():\n    from pdd.b import g\n    return g\n")
    (pkg / "b.py").write_text("from pdd.a import x\n")
    edges = import_edges(tmp_path)
    assert set(edges) == {("a", "b"), ("b", "a")}
    assert edges == {("a", "b"): ["pdd/a/x.py:2 pdd.b"], ("b", "a"): ["pdd/b.py:1 pdd.a"]}
    assert cycles(edges) == [["a", "b"]]


def main(argv: list[str]) -> int:
    src = Path(argv[0]).resolve() if argv else SRC
    edges = import_edges(src)
    units = sorted({u for e in edges for u in e})
    print(f"{len(units)} units, {len(edges)} arrows")
    found = cycles(edges)
    for comp in found:
        print(describe(comp, edges))
    if not found:
        print("no cycle")
    policy = sorted(v for (u, v) in edges if u == "policy")
    print(f"policy imports: {', '.join(policy) or 'nothing of pdd'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
