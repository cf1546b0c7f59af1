"""The package's shape, read from its source with `ast`: no import cycle, a small root, no shims, layers kept,
no prefix family (files whose shared name prefix says a folder is missing).

Every `import` and `from ... import` statement counts, at module level, inside functions and under
`TYPE_CHECKING` alike: a cycle there is still two files that cannot be read one without the other.
Importing `a.b.c` runs `a/__init__`, `a/b/__init__` and `a/b/c`, so the statement is an edge to each
of them, except to the importing module's own enclosing packages (Python runs those first anyway).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "routereplay"
NAME = "routereplay"

# the core: the data path from the engine's payload to the replayed router
CORE = ("wire", "trace", "indexer", "codec", "store", "tracefile", "transport", "layout", "runtime")
# what the core never imports (directly or through another module)
OUTSIDE_CORE = ("engines", "rl", "report", "integrations", "cli", "bench", "testing")
MAX_ROOT_MODULES = 8
MIN_SHIM_LINES = 20


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = [NAME, *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def with_packages(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `module`'s import statements run."""
    is_package = path.name == "__init__.py"
    own = set(with_packages(module)[:-1]) if not is_package else set(with_packages(module))
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for name in names:
            targets.update(m for m in with_packages(name) if m in known)
    return targets - own - {module}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imported(module, path, known) for module, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def prefix_families(root: Path) -> list[list[str]]:
    """Files of one folder that share a name prefix (the part before the first `_`): two or more modules
    (`hf.py`, `hf_child.py`, `hf_process.py`; `batch.py`, `batch_fields.py`), or a module next to a
    package of that name (`delivery.py`, `delivery/`). Each family as the paths under `root`."""
    families = []
    for folder in sorted({path.parent for path in root.rglob("*.py")}):
        members: dict[str, list[str]] = defaultdict(list)
        for path in sorted(folder.iterdir()):
            if path.suffix == ".py" and path.stem not in ("__init__", "__main__"):
                members[path.stem.lstrip("_").split("_")[0]].append(path.relative_to(root).as_posix())
            elif path.is_dir() and (path / "__init__.py").is_file():
                members[path.name].append(path.relative_to(root).as_posix() + "/")
        families.extend(sorted(names) for names in members.values() if len(names) > 1)
    return families


def in_folder(module: str, folders: tuple[str, ...]) -> bool:
    return any(module == f"{NAME}.{f}" or module.startswith(f"{NAME}.{f}.") for f in folders)


def test_no_import_cycle() -> None:
    found = cycles(graph())
    assert found == [], "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_the_cycle_finder_finds_cycles() -> None:
    """The check above can fail: a two-module loop and a three-module loop are found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_root_is_small() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {root}"


def test_no_module_only_re_exports() -> None:
    """A short module whose body is nothing but imports (and `__all__`) is a shim: import the real one.
    A folder's `__init__.py` is its face, the one place that re-exports (its docstring lists its files)."""
    shims = []
    for module, path in modules().items():
        if path.name == "__init__.py":
            continue
        text = path.read_text(encoding="utf-8")
        body = [
            node
            for node in ast.parse(text).body
            if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))  # docstrings
        ]
        only_imports = all(
            isinstance(node, (ast.Import, ast.ImportFrom))
            or (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"])
            for node in body
        )
        if body and only_imports and len(text.splitlines()) < MIN_SHIM_LINES:
            shims.append(module)
    assert shims == []


def test_the_core_never_imports_what_builds_on_it() -> None:
    edges = graph()
    leaks = {
        module: sorted(m for m in reachable(edges, module) if in_folder(m, OUTSIDE_CORE))
        for module in edges
        if in_folder(module, CORE)
    }
    assert {m: v for m, v in leaks.items() if v} == {}


def test_decoders_never_import_engines() -> None:
    edges = graph()
    wire = [m for m in edges if in_folder(m, ("wire",))]
    assert wire and all(not in_folder(m, ("engines",)) for w in wire for m in reachable(edges, w))


def test_no_prefix_family() -> None:
    """The house rule: a name prefix shared by several files means a folder is missing. Make the folder
    (`runtime/megatron/`: `replayer.py`, `binding.py`, `schedule.py`) or give one file a better noun
    (`transport/bundle_buffers.py` became `buffers.py`)."""
    found = prefix_families(PACKAGE)
    assert found == [], "files that share a name prefix (make a folder, or rename one): " + "; ".join(
        ", ".join(f"src/routereplay/{name}" for name in family) for family in found
    )


def test_the_family_finder_finds_families(tmp_path: Path) -> None:
    """The check above can fail: a module next to its `x_*` modules, two `x_*` modules, and a module next to
    a package of its name are families; a lone `x_y.py`, `__init__.py` and a file in another folder are not."""
    for name in (
        "__init__.py",
        "hf.py",
        "hf_child.py",
        "bundle_buffers.py",
        "bundle_checks.py",
        "delivery.py",
        "delivery/__init__.py",
        "set_order.py",
        "other/__init__.py",
        "other/set_ranker.py",
        "notes_a.txt",
        "notes_b.txt",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("", encoding="utf-8")
    assert prefix_families(tmp_path) == [
        ["bundle_buffers.py", "bundle_checks.py"],
        ["delivery.py", "delivery/"],
        ["hf.py", "hf_child.py"],
    ]
