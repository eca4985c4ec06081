"""The package's import graph has no circle (issue 34): no module of `ddl_wgpu` or `ddl_ref` imports, directly or
through others, a module that imports it back, not even lazily inside a function (a lazy import only hides a
circle until the day it runs first). Read with `ast`, nothing is imported; imports under `if TYPE_CHECKING:`
are type hints, not imports at run time, and are left out. `ddl_ref` imports nothing from `ddl_wgpu`."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ddl_wgpu", "ddl_ref")


def modules() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its own name, for its __init__.py)."""
    found = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node at any depth, except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the packages that module `name` imports: `import a.b`, `from a.b import c` (a.b.c when
    c is a module, else a.b)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
            continue
        base = node.module or ""
        if node.level:  # relative: from . import x, from .m import x
            base = ".".join(
                package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
            )
        for a in node.names:
            sub = f"{base}.{a.name}"
            if sub in known:
                out.add(sub)
            elif base in known:
                out.add(base)
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circle(g: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports as [a, b, ..., a], or None (depth-first search, no recursion)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(g):
        if start in state:
            continue
        path, its = [start], [iter(sorted(g[start]))]
        state[start] = 1
        while path:
            nxt = next(its[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                its.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                its.append(iter(sorted(g[nxt])))
    return None


def test_the_import_graph_has_no_circle():
    g = graph()
    assert (
        "ddl_wgpu.jobs.sweep" in g and "ddl_ref.model" in g and "ddl_wgpu.ops.matmul" in g
    )  # it reads the tree
    found = circle(g)
    assert found is None, "import circle: " + " -> ".join(found)


def test_ddl_ref_imports_nothing_from_ddl_wgpu():
    g = graph()
    leaks = {
        m: sorted(d for d in deps if d.startswith("ddl_wgpu"))
        for m, deps in g.items()
        if m.startswith("ddl_ref")
    }
    assert not any(leaks.values()), leaks


def test_the_check_finds_a_circle_and_a_lazy_import(tmp_path):
    """The reader sees a function-local import and the search finds the circle it closes (what the sweep's
    modules had: `sweep` importing `sweep_checks` lazily, `sweep_checks` importing `sweep` at the top)."""
    (tmp_path / "a.py").write_text("import os\n\ndef f():\n    from pkg.b import x\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nfrom pkg import a\nif TYPE_CHECKING:\n"
                                   "    from pkg import c\n")  # fmt: skip
    (tmp_path / "c.py").write_text("from pkg.b import y\n")
    known = {f"pkg.{n}": tmp_path / f"{n}.py" for n in "abc"}
    g = {n: imports_of(n, p, known) for n, p in known.items()}
    assert g == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.b"}}
    assert circle(g) == ["pkg.a", "pkg.b", "pkg.a"]
    assert circle({"pkg.a": {"pkg.b"}, "pkg.b": set(), "pkg.c": {"pkg.a", "pkg.b"}}) is None


# ---------------------------------------------------------------------------------------------------------
# the layers (issue 38): one folder per layer, and no import runs upward. A module's layer is its first folder
# under ddl_wgpu/ (files/hf/ is files/), or its own name for the three top-level modules; `ddl_ref` is the floor.
# Each layer may import itself and what this table lists, nothing else of the packages.

BELOW = {
    "errors": set(),
    "files": {"errors"},
    "data": {"files", "errors"},
    "runtime": {"errors"},
    "ops": {"runtime", "errors"},
    "engine": {"ops", "runtime", "files", "errors"},
    "backend": {"engine", "ops", "runtime", "files", "errors"},
    "jobs": {"backend", "engine", "ops", "runtime", "files", "data", "errors"},
    "cli": {"jobs", "backend", "engine", "ops", "runtime", "files", "data", "errors"},
}


def layer(module: str) -> str:
    """`ddl_wgpu.files.hf.convert` -> files, `ddl_wgpu.backend` -> backend, `ddl_ref.ops` -> ddl_ref."""
    parts = module.split(".")
    if parts[0] == "ddl_ref":
        return "ddl_ref"
    return parts[1] if len(parts) > 1 else "package"


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import of `g` that its layer's row of BELOW does not allow, as 'a (layer) -> b (layer)'."""
    bad = []
    for mod, deps in sorted(g.items()):
        src = layer(mod)
        if src in ("ddl_ref", "package"):
            continue
        for dep in sorted(deps):
            dst = layer(dep)
            if dst not in ("ddl_ref", src) and dst not in BELOW[src]:
                bad.append(f"{mod} ({src}) -> {dep} ({dst})")
    return bad


def test_every_module_has_a_layer():
    """A new top-level module or folder has to be given its place in BELOW (with its reason in
    ddl_wgpu/__init__.py) before it passes."""
    stray = sorted(m for m in graph() if m.startswith("ddl_wgpu.") and layer(m) not in BELOW)
    assert not stray, f"modules outside every layer (add them to BELOW): {stray}"


def test_no_import_runs_upward():
    g = graph()
    assert "ddl_wgpu.files.hf.convert" in g and "ddl_wgpu.engine.net" in g  # it reads the folders
    bad = upward(g)
    assert not bad, "imports that run upward:\n" + "\n".join(bad)


def test_the_layer_check_catches_an_upward_import():
    g = {"ddl_wgpu.runtime.gpu": {"ddl_wgpu.engine.net"}, "ddl_wgpu.engine.net": {"ddl_wgpu.runtime.gpu"},
         "ddl_wgpu.files.lazy": {"ddl_ref.params", "ddl_wgpu.errors"}}  # fmt: skip
    assert upward(g) == ["ddl_wgpu.runtime.gpu (runtime) -> ddl_wgpu.engine.net (engine)"]
