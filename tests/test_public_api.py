"""The public face: what ``import autocast`` offers is documented with an example, and the
package's modules import one another one way only."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autocast
import autocast.optax

SRC = Path(autocast.__file__).parent
PUBLIC = [(autocast, name) for name in autocast.__all__] + [
    (autocast.optax, n) for n in autocast.optax.__all__
]


@pytest.mark.parametrize("module, name", PUBLIC, ids=[f"{m.__name__}.{n}" for m, n in PUBLIC])
def test_every_public_name_is_documented_with_an_example(module, name):
    obj = getattr(module, name)
    doc = (
        inspect.getdoc(obj) if (inspect.isclass(obj) or callable(obj)) else _data_doc(module, name)
    )
    assert doc and ">>>" in doc, f"{name}: no docstring with a runnable example"
    if inspect.isfunction(obj):
        assert "Returns:" in doc, f"{name}: no Returns: section"
        if inspect.signature(obj).parameters:
            assert "Args:" in doc, f"{name}: no Args: section"


def _data_doc(module, name):
    """The string literal that follows a module-level assignment of ``name``."""
    for path in SRC.rglob("*.py"):
        body = ast.parse(path.read_text()).body
        for node, after in zip(body, body[1:]):
            targets = (
                node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            )
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    return after.value.value
    return None


def test_the_public_face_holds_no_implementation():
    tree = ast.parse((SRC / "__init__.py").read_text())
    kinds = {type(node).__name__ for node in tree.body}
    assert kinds <= {"Expr", "ImportFrom", "Import", "Assign"}, kinds
    exported = {n for n in dir(autocast) if not n.startswith("_")} - {"optax"}
    assert exported == set(autocast.__all__), exported ^ set(autocast.__all__)


def _imports(path: Path) -> set[str]:
    """The autocast modules ``path`` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autocast"):
            for alias in node.names:  # `from autocast._src.x import y` may import module y
                child = f"{node.module}.{alias.name}"
                found.add(child if _module_path(child) else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("autocast")}
    return found


def _module_path(name: str) -> Path | None:
    base = SRC.parent.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def test_no_import_circles():
    modules = {
        ".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in SRC.rglob("*.py")
    }
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    done, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m) :] + [m]))
        if m in done:
            return
        stack.append(m)
        for d in graph[m]:
            visit(d)
        stack.pop()
        done.add(m)

    for m in graph:
        visit(m)
    assert "autocast._src.transform.handlers" not in graph["autocast._src.transform.interpreter"]


def test_a_missing_optional_extra_is_named_on_import():
    # autocast itself needs only JAX; autocast.optax names the extra that brings optax
    code = (
        "import sys; sys.modules['optax'] = None\n"
        "import autocast\n"
        "try:\n"
        "    import autocast.optax\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, '|', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "optax | autocast.optax needs optax, which the optax extra brings: "
        "pip install 'jax-autocast[optax]'"
    )


def test_the_code_explains_itself_without_issue_numbers():
    # a comment or test that points at the tracker says nothing to a reader without it
    root = Path(__file__).parents[1]
    pattern = re.compile(r"\b[Ii]ssue\s*#?\d+|\bitem \d+\b")
    found = []
    for folder in ("src", "tests", "benchmarks", "examples"):
        for path in (root / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and "pattern = re.compile" not in line:
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert found == []


def test_every_public_name_is_on_the_api_page():
    import docs_pages

    import autocast.optax as ao

    page = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    assert page == docs_pages.api_markdown(), "docs/api.md is out of date: make docs"
    for name in autocast.__all__:
        assert f"| `autocast.{name}` |" in page, name
    for name in ao.__all__:
        assert f"| `autocast.optax.{name}` |" in page, name
