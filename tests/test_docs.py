"""The docs site's code blocks run, and its API reference covers the public names.

Every ```python block in `docs/**/*.md` runs, page by page: the blocks of one page run in order in one namespace
(a later block uses what an earlier one defined, as a reader pasting them one after another would), in a fresh
temporary working directory. Blocks may be indented (inside content tabs or admonitions): the fence's indentation
is removed. Blocks in other languages (```julia, ```text, ```sh) never run.

A Python block that cannot run here (a multi-host snippet that needs several processes) is marked by a line
holding only `<!-- docs: no-run -->` right before its fence (blank lines in between are allowed); the marker is
an HTML comment, so the site does not show it. Keep those few: `MAX_NO_RUN` caps them, and a marker that is
not followed by a ```python fence fails the test. The pages assert what they claim
(`assert m["enc"] is m["dec"]`), so a block that runs is a checked claim, not only one that does not crash.
"""

from __future__ import annotations

import pathlib
import re
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NO_RUN = "<!-- docs: no-run -->"
MAX_NO_RUN = 8

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def blocks(text: str) -> list[tuple[int, str, str, bool]]:
    """(line number, language, dedented code, marked no-run) of every fenced block, in page order."""
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().splitlines()
        marked = bool(before) and before[-1].strip() == NO_RUN
        out.append((text.count("\n", 0, m.start()) + 1, m["lang"], textwrap.dedent(m["body"]), marked))
    return out


PAGES = sorted(p for p in DOCS.rglob("*.md") if "```python" in p.read_text())


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": f"docs.{page.stem}"}
    for line, lang, code, marked in blocks(page.read_text()):
        if lang != "python" or marked:
            continue
        try:
            exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), scope)
        except Exception as e:
            raise AssertionError(f"{page.relative_to(ROOT)}, the block at line {line} failed: {e!r}") from e


def test_no_run_markers_are_few_and_each_marks_a_python_block():
    marked, markers = [], 0
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        markers += sum(line.strip() == NO_RUN for line in text.splitlines())
        marked += [(page.name, line) for line, lang, _, m in blocks(text) if m and lang == "python"]
    assert markers == len(marked), "a no-run marker that is not right before a ```python fence"
    assert len(marked) <= MAX_NO_RUN, f"too many blocks marked no-run: {marked}"


def test_every_page_with_code_runs_some():
    for page in PAGES:
        assert any(lang == "python" and not m for _, lang, _, m in blocks(page.read_text())), page


def test_api_reference_covers_every_public_name():
    import optim

    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: optim\.(\w+)\s*$", page.read_text(), re.M))
    assert sorted(set(optim.__all__) - documented) == []
    assert sorted(documented - set(optim.__all__)) == []


def test_benchmarks_page_includes_the_results_file():
    # pymdownx.snippets includes bench/RESULTS.md at build time (check_paths: a missing file fails the build).
    assert '--8<-- "bench/RESULTS.md"' in (DOCS / "benchmarks.md").read_text()
    assert (ROOT / "bench" / "RESULTS.md").exists()
