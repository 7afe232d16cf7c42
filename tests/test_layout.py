"""The tree shows the architecture: imports go one way, from the model at the bottom to the command
line at the top, with no cycles; benchmarks and test doubles live outside the package; a task
domain is a folder whose files a reader can take in one at a time."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mopd"
# Bottom to top, the order data flows through them; a part may import only parts on lower rows.
LAYERS = [
    {"artifacts", "machine", "stats"},
    {"model"},
    {"compute", "vllm_plugin", "envs"},
    {"convert"},  # checkpoints made from what users have; attention transfer reads the general train split (envs)
    {"recipe", "cluster"},
    {"precision"},  # its refusals are RecipeErrors naming the field
    {"rollout"},
    {"base"},
    {"rl"},
    {"distill"},
    {"bench"},
    {"pipeline", "sweep", "validate"},
    {"cli"},
]
MAX_ENV_FILE_LINES = 350


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """Module → the package modules it imports (at any depth of the file: lazy imports count)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while component[-1:] != [v]:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def rank(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part(module) in layer)


def test_no_module_imports_its_importer():
    assert cycles(import_graph()) == []


def test_a_cycle_is_found_where_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_part_sits_on_a_layer_and_imports_only_lower_ones():
    graph = import_graph()
    parts = {part(m) for m in graph} | {part(t) for ts in graph.values() for t in ts}
    assert parts - {"mopd"} <= set().union(*LAYERS), f"parts with no layer: {parts - set().union(*LAYERS)}"
    upward = sorted(
        f"{a} -> {b}" for a, targets in graph.items() for b in targets
        if part(a) != part(b) and "mopd" not in (part(a), part(b)) and rank(b) >= rank(a)
    )  # fmt: skip
    assert upward == []


def test_benchmarks_and_test_doubles_live_outside_the_package():
    inside = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                    if (p.name.startswith("bench") and p.parent.name != "bench") or p.name == "fakes.py")  # fmt: skip
    assert inside == []
    listed = (ROOT / "benchmarks" / "README.md").read_text()
    for benchmark in sorted((ROOT / "benchmarks").glob("*.py")):
        if benchmark.name not in ("__init__.py", "common.py"):
            assert f"`{benchmark.name}`" in listed or f"{benchmark.stem}" in listed, benchmark.name


def test_no_file_of_a_task_domain_is_longer_than_a_reader_takes_in_at_once():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (PACKAGE / "envs").rglob("*.py")}
    assert {path: n for path, n in lengths.items() if n > MAX_ENV_FILE_LINES} == {}
