"""The documentation runs: every ```python block in README.md and docs/*.md is executed.

The blocks of one page run in the order they appear, in one namespace of their own, so a
block may use what an earlier block of the same page defined; pages never share names. A
block that is deliberately not runnable carries the HTML comment ``<!-- not run: reason -->``
on the line right before its fence, and its test is skipped with that reason. Each block is
one test (``page#index``); run alone, a block first runs the blocks of its page before it.

The pages are also checked for what a reader cannot follow: relative links to files or
headings that do not exist, and ``python -m autocast`` without the ``.venv/bin/`` that makes
it work when the environment is not activated.
"""

from __future__ import annotations

import dataclasses
import re
import traceback
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
README_LIMIT = 8 * 1024

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    not_run: str | None  # the reason, for a block marked not to be run


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown text, in order, with its language and marker."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, language = opening.groups()
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not closing.match(lines[i]):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        marker = NOT_RUN.match(lines[start - 1]) if start else None
        code = "\n".join(body) + "\n"
        blocks.append(Block(start + 1, language, code, marker and marker.group(1)))
        i += 1
    return blocks


def python_blocks(page: str) -> list[Block]:
    return [b for b in fenced_blocks((ROOT / page).read_text()) if b.language == "python"]


BLOCKS = {page: python_blocks(page) for page in PAGES}
CASES = [(page, index) for page in PAGES for index in range(len(BLOCKS[page]))]


@dataclasses.dataclass
class _PageRun:
    """How far the blocks of one page have run in this process, in their shared namespace."""

    namespace: dict[str, Any]
    next: int = 0
    failed: int | None = None
    error: str = ""


_RUNS: dict[str, _PageRun] = {}


def _run_through(page: str, index: int) -> _PageRun:
    """Runs the blocks of ``page`` up to ``index`` that have not run yet, in order."""
    run = _RUNS.setdefault(page, _PageRun({"__name__": f"docs:{page}"}))
    while run.next <= index:
        block = BLOCKS[page][run.next]
        run.next += 1
        if block.not_run is not None or run.failed is not None:
            continue
        # padded so that a traceback's line numbers are the page's own
        code = compile("\n" * block.line + block.code, str(ROOT / page), "exec")
        try:
            exec(code, run.namespace)
        except Exception:  # noqa: BLE001 - reported with the page and block below
            run.failed, run.error = run.next - 1, traceback.format_exc()
    return run


@pytest.mark.slow
@pytest.mark.parametrize(("page", "index"), CASES, ids=[f"{p}#{i}" for p, i in CASES])
def test_code_block_runs(page: str, index: int) -> None:
    block = BLOCKS[page][index]
    if block.not_run is not None:
        pytest.skip(f"{page}, line {block.line}: not run: {block.not_run}")
    run = _run_through(page, index)
    if run.failed == index:
        message = f"{page}, block {index} (line {block.line}) raised:\n{run.error}"
        pytest.fail(message, pytrace=False)
    if run.failed is not None:
        earlier = BLOCKS[page][run.failed]
        pytest.fail(
            f"{page}, block {index} (line {block.line}) not run: block {run.failed} "
            f"(line {earlier.line}), which it may build on, raised:\n{run.error}",
            pytrace=False,
        )


@pytest.mark.parametrize("page", PAGES)
def test_not_run_markers_stand_before_python_blocks(page: str) -> None:
    """A marker that precedes anything but a Python block would exempt nothing: say so."""
    lines = (ROOT / page).read_text().splitlines()
    for i, line in enumerate(lines):
        marker = NOT_RUN.match(line)
        if marker:
            after = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            where = f"{page}:{i + 1}"
            assert after and after.group(3) == "python", f"{where}: marker before no python block"
            assert marker.group(1), f"{where}: a not-run marker must give its reason"


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            slug = _slug(line.lstrip("#"))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced blocks and inline code."""
    out, in_code = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


@pytest.mark.parametrize("page", [*PAGES, "examples/README.md"])
def test_relative_links_reach_files_and_headings(page: str) -> None:
    source = ROOT / page
    for target in LINK.findall(_prose(source.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: outside the repository
        path, _, anchor = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        assert linked.exists(), f"{page}: link to {target}, which the repository does not contain"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{page}: link to {target}: no such heading"


@pytest.mark.parametrize("page", [*PAGES, "examples/README.md"])
def test_commands_name_the_projects_environment(page: str) -> None:
    """``python -m autocast`` fails unless the environment is active; ``.venv/bin/python``
    works from the repository after ``make test`` or ``make demo``."""
    text = (ROOT / page).read_text()
    bare = [m.start() for m in re.finditer(r"(?<![\w/.])python3? -m autocast", text)]
    lines = [text.count("\n", 0, at) + 1 for at in bare]
    assert not lines, f"{page}, lines {lines}: write .venv/bin/python -m autocast"


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= README_LIMIT, f"README.md: {len(text.encode())} bytes"
    first = fenced_blocks(text)[0].code
    assert "make demo" in first and "make test" in first


STALE = re.compile(
    r"\bSPEC\s*\d"  # sections of a specification the repository does not hold
    r"|\b[Ii]ssues?\s*#?\d+|\bPR\s*#\d+"  # issue and pull-request numbers
    r"|(?<![\w.])/(?:work|home|Users|root)/"  # absolute paths of the machine that wrote it
    r"|\w\.py:\d+"  # line numbers of source files, stale after any edit
)


@pytest.mark.parametrize("page", [*PAGES, "examples/README.md"])
def test_no_references_a_reader_cannot_follow(page: str) -> None:
    text = (ROOT / page).read_text()
    found = [(text.count("\n", 0, m.start()) + 1, m.group()) for m in STALE.finditer(text)]
    assert not found, f"{page}: {found}"
