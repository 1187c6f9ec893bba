"""The package's import graph: no cycles, and no import from a lower layer to a higher one.

Every `import shardserve.x` and `from shardserve.x import y` counts, at the top of a module, inside a function or
under TYPE_CHECKING alike: an import put inside a function runs later, but it is still an arrow. A model module
that the registry imports by name (importlib, at build time) is not a static import and is not counted.

LAYERS is the one place the layer order is written down (docs/development.md points here), lowest first. A module
belongs to the layer of the longest entry that names it or a package above it ("" is the package itself, and
only it). A module may import from its own layer and the ones below; a cycle is refused within a layer too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardserve

PACKAGE = Path(shardserve.__file__).parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Import nothing of shardserve but each other.
    ("leaf", ("envs", "version", "heap", "transfers", "process_name", "yaml_config", "kv_cache_dtype",
              "weight_format")),
    # What files and ranks hold, read without any model code: checkpoints (GGUF, quantized tensors), step plans.
    ("formats", ("weights.gguf_loader", "weights.quantized", "weights.fp4", "wire")),
    # A model's and an engine's settings, and a request as front ends and the engine both see it. The registry
    # names each architecture's module and imports it only when a model is built.
    ("config", ("config", "models.registry", "model_files", "tokenizer", "requests")),
    ("kernels", ("kernels",)),
    ("distributed", ("distributed",)),
    ("layers", ("layers", "attention")),
    ("weights", ("weights",)),
    ("models", ("models",)),
    # The planner's arithmetic mirrors the engine's allocations (it reads the sampler's and graphs' sizes) and the
    # engine budgets its KV cache with it.
    ("engine", ("engine", "planner", "planner_nemotron_h", "planner_mla")),
    ("ipc", ("ipc",)),
    ("front ends", ("entrypoints", "pool", "bench", "recipes", "example_model")),
    ("command line", ("cli", "__main__", "")),
]

# (importer, imported) -> why the arrow is allowed to point up. Keep it empty.
ALLOWED: dict[tuple[str, str], str] = {}

# A module of each strongly connected set allowed to stay one -> why. Keep it as small as it can be.
ALLOWED_CYCLES: dict[str, str] = {
    "shardserve.distributed.control_plane": "distributed/'s start-up: the process group builds the control plane and "
    "the all-reduce methods, which exchange handles over the control plane (imports inside functions); untangling "
    "it is the next step of the structure work",
}


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


MODULES = _module_names()


def _resolve(name: str) -> str | None:
    """The module of the package a dotted name is or lies in (an attribute's module), None outside it."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for each import of a shardserve module anywhere in `module`'s source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from a import b`: the module a.b where there is one, else an attribute of a.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name == "shardserve" or name.startswith("shardserve.") else None
            if target is not None and target != module:
                found.append((target, node.lineno))
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> int | None:
    relative = module.removeprefix("shardserve").removeprefix(".")
    best = None
    for rank, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if relative == entry or (entry and relative.startswith(entry + ".")):
                if best is None or len(entry) > best[0]:
                    best = (len(entry), rank)
    return None if best is None else best[1]


def _cycles() -> list[list[str]]:
    """One cycle through each strongly connected set of modules (Tarjan's algorithm), as a path a -> ... -> a."""
    edges = {m: sorted({t for t, _ in targets}) for m, targets in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(set(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return [_path_back(min(c), c, edges) for c in components if not ALLOWED_CYCLES.keys() & c]


def _path_back(start: str, component: set[str], edges: dict[str, list[str]]) -> list[str]:
    """A shortest path from start back to itself inside the component (breadth first)."""
    came_from = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in edges[node]:
                if nxt == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, node, start]
                if nxt in component and nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def test_the_import_graph_has_no_cycle():
    cycles = _cycles()
    assert not cycles, "import cycles (each shown once, through one of its modules):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def test_every_module_has_a_layer():
    unplaced = [m for m in MODULES if _layer(m) is None]
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}; add each to the layer it belongs to"


def test_no_import_points_up_a_layer():
    upward = []
    for module, targets in GRAPH.items():
        for target, line in targets:
            if (module, target) in ALLOWED:
                continue
            mine, theirs = _layer(module), _layer(target)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {module} ({LAYERS[mine][0]}) "
                              f"imports {target} ({LAYERS[theirs][0]})")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))


@pytest.mark.parametrize("pair", sorted(ALLOWED))
def test_each_allowed_arrow_still_exists(pair):
    assert any(target == pair[1] for target, _ in GRAPH.get(pair[0], ())), f"{pair} is allowed but no longer imported"
