"""The package's shape (docs/architecture.md): folders on floors, imports only downward, no import circle,
no library import hidden inside a function, and a one-line description atop every folder."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> floor: a module may import modules of its own floor or lower, never higher
FLOORS = {"version": 0, "assets": 0, "parallel": 0, "kernels": 1, "model": 2, "convert": 3, "io": 4,
          "latim": 5, "tasks": 6, "cli": 7, "": 8}  # fmt: skip
# where each installed package lives in the repository (pyproject's package-dir)
SOURCES = {
    "latim_jax": ROOT / "latim_jax",
    "latim_jax.kernels": ROOT / "kernels",
    "latim_jax.convert": ROOT / "convert",
}


def modules() -> dict[str, Path]:
    """Every module of the library: dotted name -> file."""
    out = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if package == "latim_jax" and parts[0] in ("kernels", "convert"):
                continue
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = modules()


def floor(module: str) -> int:
    """The floor of a module: that of its folder (latim_jax.<folder>...), the package top last."""
    parts = module.split(".")
    return FLOORS[parts[1]] if len(parts) > 1 else FLOORS[""]


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported library module, inside a function?) of every import statement of a file."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, inner) for a in child.names if a.name.startswith("latim_jax"))
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("latim_jax"):
                for a in child.names:  # `from pkg import sub` imports the submodule when there is one
                    sub = f"{child.module}.{a.name}"
                    found.append((sub if sub in MODULES else child.module, inner))
            visit(child, inner)

    visit(tree, False)
    return found


GRAPH = {name: sorted({m for m, _ in imports(path)} - {name}) for name, path in MODULES.items()}


def test_the_layout_is_what_the_floors_name():
    folders = {name.split(".")[1] for name in MODULES if name.count(".") >= 1}
    assert folders == set(FLOORS) - {""}, folders
    assert len(MODULES) > 40


def test_every_import_goes_down_or_sideways():
    upward = [
        (name, target) for name, targets in GRAPH.items() for target in targets if floor(target) > floor(name)
    ]
    assert not upward, upward


def test_no_import_circle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(name, path):
        state[name] = 1
        for target in GRAPH.get(name, ()):
            if state.get(target) == 1:
                pytest.fail(f"import circle: {' -> '.join(path[path.index(target) :] + [target])}")
            if state.get(target) is None:
                walk(target, path + [target])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            walk(name, [name])


def test_no_library_import_inside_a_function():
    """Imports inside functions are for optional third-party packages only (torch, transformers,
    tokenizers, matplotlib, tqdm): never a library module, so no circle hides behind one."""
    hidden = [(name, m) for name, path in MODULES.items() for m, inner in imports(path) if inner]
    assert not hidden, hidden


def test_every_folder_says_what_lives_there():
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and len(doc.split("\n")[0]) > 20, name


def test_the_graph_is_read_right():
    """The reader sees imports the layout must forbid: a check that cannot fail would prove nothing."""
    assert "latim_jax.kernels.dispatch" in GRAPH["latim_jax.model.mixers"]
    assert "latim_jax.latim.mamba" in GRAPH["latim_jax.latim.kinds"]  # `from latim_jax.latim import mamba`
    assert floor("latim_jax.latim.scores") > floor("latim_jax.kernels.decay")
    assert floor("latim_jax.cli.main") > floor("latim_jax.tasks.evaluate")


def test_pyproject_installs_every_package():
    """A non-editable install ships exactly the packages pyproject names: every folder of the library
    must be among them (an editable install would hide a missing one)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert packages == listed, sorted(packages ^ listed)
