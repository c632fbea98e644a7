"""The documentation pages made from the code, and the one command that makes them again:

    .venv/bin/python tests/docs_pages.py        # or: make docs

- docs/api.md: every public name (``autocast.__all__`` and ``autocast.optax.__all__``) with
  the first sentence of its docstring, grouped by what it is for;
- the table of docs/default_policy.md: ``autocast.describe_default_policy()``, spliced in
  between the page's own text;
- docs/support_matrix.md: ``tests/support_matrix.py``'s table.

The tests check each page against the code (tests/test_public_api.py, tests/test_rules.py,
tests/test_support_matrix.py), so a change that forgets to run this fails there.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]

# Where a public name is defined -> the section of the API page and the page that explains
# it. The first prefix that matches decides.
SECTIONS = (
    ("autocast._src.transform", "Mixed precision", "amp.md"),
    ("autocast._src.policy.precision", "Precision rules", "amp.md#changing-the-policy"),
    ("autocast._src.policy.table", "The default policy", "default_policy.md"),
    ("autocast._src.policy", "Dtype policies and casting (jmp's names)", "migration.md"),
    ("autocast._src.fp8", "Float8", "fp8.md"),
    (
        "autocast._src.scaling.optax",
        "Loss scaling with optax (`autocast.optax`)",
        "loss_scaling.md",
    ),
    ("autocast._src.scaling", "Loss scaling", "loss_scaling.md"),
    ("autocast._src.state", "Training state precision", "training_state.md"),
    ("autocast._src.tools.report", "What ran in which dtype", "amp.md"),
    ("autocast._src.tools.plan", "Planning for a chip you do not have", "planning.md"),
    ("autocast._src.tools", "The numerics debugger", "diagnose.md"),
)


def _summary(obj: Any) -> str:
    """The first sentence of ``obj``'s docstring, on one line, in Markdown."""
    doc = inspect.getdoc(obj) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    match = re.match(r"(.+?)(?<!e\.g)(?<!i\.e)\.(\s|$)", paragraph)
    sentence = match.group(1) + "." if match else paragraph
    sentence = re.sub(r":(?:func|class|meth|data|mod|attr):`~?([^`]+)`", r"`\1`", sentence)
    return sentence.replace("``", "`")


def _where(obj: Any, default: str) -> str:
    module = getattr(obj, "__module__", None) or default
    if isinstance(obj, dict):  # a table or a policy: named in the module that builds it
        module = default
    return module


def public_names() -> list[tuple[str, Any, str]]:
    """``(qualified name, object, defining module)`` of every public name."""
    import autocast

    found = [
        (f"autocast.{n}", getattr(autocast, n), _where(getattr(autocast, n), ""))
        for n in autocast.__all__
    ]
    try:
        import autocast.optax as ao
    except ModuleNotFoundError:  # without optax the page is the same: it is made with it
        ao = None
    if ao is not None:
        found += [
            (
                f"autocast.optax.{n}",
                getattr(ao, n),
                _where(getattr(ao, n), "autocast._src.scaling.optax"),
            )
            for n in ao.__all__
        ]
    return found


_CONSTANTS = {
    "autocast.DEFAULT_PRECISION_TABLE": "autocast._src.policy.table",
    "autocast.default_amp_policy": "autocast._src.policy.table",
}


def api_markdown() -> str:
    grouped: dict[str, list[str]] = {title: [] for _, title, _ in SECTIONS}
    links = {title: page for _, title, page in SECTIONS}
    for name, obj, module in public_names():
        module = _CONSTANTS.get(name, module)
        title = next((t for prefix, t, _ in SECTIONS if module.startswith(prefix)), None)
        if title is None:
            raise ValueError(
                f"{name} is defined in {module}, which no section of the API page covers"
            )
        kind = "class" if inspect.isclass(obj) else ("function" if callable(obj) else "value")
        summary = _summary(obj) if kind != "value" else _VALUES[name]
        grouped[title].append(f"| `{name}` | {kind} | {summary} |")
    lines = [
        "# API",
        "",
        "Every public name, with the first sentence of its docstring; each section links the page",
        "that explains it. `help(autocast.<name>)` gives the whole docstring, with an example.",
        "Made from the code by `make docs`; a test checks that this page is up to date.",
    ]
    for title, rows in grouped.items():
        if not rows:
            continue
        lines += ["", f"## {title}", "", f"Explained in [{links[title]}]({links[title]}).", ""]
        lines += ["| name | kind | what it is |", "|---|---|---|", *sorted(rows)]
    return "\n".join(lines) + "\n"


# Values have no docstring of their own: their summaries.
_VALUES = {
    "autocast.DEFAULT_PRECISION_TABLE": (
        "The default policy as data: one `(primitive name, rule, reason)` row per primitive."
    ),
    "autocast.default_amp_policy": (
        "The policy `amp` uses unless given another: the table's rules keyed by primitive, and "
        "the `amp_stop`, `amp_step` and `amp_default` scopes."
    ),
}


def policy_page(current: str) -> str:
    """docs/default_policy.md with its table replaced by the code's."""
    import autocast

    table = autocast.describe_default_policy()
    first = table.splitlines()[0]
    start = current.index(first)
    end = current.index("\n\n", start)
    return current[:start] + table.rstrip("\n") + current[end:]


def write_all() -> list[str]:
    """Writes every generated page; returns the ones that changed."""
    sys.path.insert(0, str(Path(__file__).parent))
    import support_matrix

    pages = {
        ROOT / "docs" / "api.md": lambda _: api_markdown(),
        ROOT / "docs" / "default_policy.md": policy_page,
        ROOT / "docs" / "support_matrix.md": lambda _: support_matrix.markdown(),
    }
    changed = []
    for path, make in pages.items():
        old = path.read_text() if path.exists() else ""
        new = make(old)
        if new != old:
            path.write_text(new)
            changed.append(str(path.relative_to(ROOT)))
    return changed


if __name__ == "__main__":
    done = write_all()
    print("rewrote " + ", ".join(done) if done else "every generated page was up to date")
