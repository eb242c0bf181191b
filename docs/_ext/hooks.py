"""mkdocs hooks of the docs site (mkdocs.yml, `hooks:`).

- The header shows optim's version: `site_name` becomes "optim 0.1.0", read from `optim/__init__.py` (the one place
  the version is written) without importing the package.
- The benchmarks page shows the measured sections of bench/RESULTS.md (`bench_results`), and a page's snippet line
  `--8<-- "bench/NAME.md:section"` is included here, not by the snippets extension: both pass through `scrub`, which
  drops the maintainers' bookkeeping (commits, measured-at stamps, machine load) that bench/*.md keep.
- The changelog page includes CHANGELOG.md, its links to `docs/...` made relative to the docs folder.
- Maths is MathML written in the pages (`<math>`), which browsers typeset themselves: nothing to load, offline.
- In a table, a name in code may break only after a dot, an underscore, an opening parenthesis, a comma or an
  equals sign (`table_code_breaks`: a `<wbr>` there; docs/stylesheets/extra.css keeps words whole), so that
  `WeightDecay` or `contrib.schedule_free_adamw` never break mid-word.
- A table of bench results wider than MAX_COLUMNS is split in two, each with the first column (`split_wide_tables`):
  wider, its right-hand columns would sit behind a sideways scrollbar in the content column.
- A click on a figure opens its image at full size (`image_links`): the figures are drawn 1280 px wide and the
  content column shows them at about half that.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def on_config(config, **kwargs):
    init = (ROOT / "optim" / "__init__.py").read_text()
    version = re.search(r'^__version__ = "([^"]+)"', init, re.M).group(1)
    config.site_name = f"optim {version}"
    config.extra["version"] = version
    return config


BENCH_MARK = "<!-- bench/RESULTS.md: the measured sections -->"
BENCH_SECTIONS = ("Summary", "Workloads", "Eager per-call overhead", "Setup time")


def bench_results(text: str) -> str:
    """The parts of bench/RESULTS.md (written by `python -m bench`) that a user reads: the machine, the method, the
    candidates and the measured sections, without the maintainers' notes and the commits each section measured."""
    head, *sections = re.split(r"^## ", text, flags=re.M)
    keep = [p for p in head.split("\n\n") if p.startswith(("Machine:", "Method:", "Candidates:"))]
    keep += ["## " + s.rstrip() for s in sections if s.startswith(BENCH_SECTIONS)]
    return split_wide_tables(scrub("\n\n".join(keep)))


# A results table wider than this is split: at a 1280 px window the content column is 720 px and the theme gives
# each header cell at least 5rem, so 6 columns fit and 7 do not (771 px).
MAX_COLUMNS = 6
# Where a wide table splits, the first of these columns it has: a workload's table into the step time and the first
# call and memory, the summary into the large matrices and the many small ones and the models. Another table splits
# in half.
SPLIT_BEFORE = ("first call (s)", "10000x1.6k")
MD_TABLE = re.compile(r"^\|.*\|[ \t]*\n\|[ \t:|-]+\|[ \t]*\n(?:\|.*\|[ \t]*(?:\n|$))*", re.M)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def split_wide_tables(text: str, max_columns: int = MAX_COLUMNS) -> str:
    """`text` (markdown) with each table of more than `max_columns` columns split in two (again while wider): both
    start with the first column (what each row is), the second with the columns from the first of SPLIT_BEFORE the
    table has, or from its middle."""
    def split(m: re.Match) -> str:
        rows = [_cells(line) for line in m.group(0).rstrip("\n").split("\n")]
        if len(rows[0]) <= max_columns:
            return m.group(0)
        at = next((rows[0].index(c) for c in SPLIT_BEFORE if c in rows[0][2:]), (len(rows[0]) + 1) // 2)
        parts = ["\n".join("| " + " | ".join(r[:1] + r[lo:hi]) + " |" for r in rows) + "\n"
                 for lo, hi in ((1, at), (at, len(rows[0])))]
        return "\n".join(split_wide_tables(p, max_columns) for p in parts)
    return MD_TABLE.sub(split, text)


_STAMP = r"measured \d{4}-\d\d-\d\d(?: \d\d:\d\d)?(?: UTC)?(?:, load average \d+(?:\.\d+)? -> \d+(?:\.\d+)?)?"
_SCRUB = (
    # "Each section names the optim commit it measured; the repository changes often, so ..." (may wrap anywhere)
    (r"\s*Each\s+section\s+names\s+the\s+optim\s+commit\s+it\s+measured;[^.]*\.", ""),
    # " (optim 609b3bf)", " (optim 7e67ab7+dirty -> 4dc3c0f+dirty (optim changed during the run))"
    (r"\s*\(optim [0-9a-f]{7,40}\b[^()]*(?:\([^()]*\)[^()]*)*\)", ""),
    # "...(5 weight/bias pairs); measured 2026-12-01 15:30 UTC. Time per call" -> "...pairs). Time per call"
    (r";\s+" + _STAMP + r"(?=\.(?!\d))", ""),
    # "; measured 2026-12-03 19:13 UTC, load average 1.5 -> 1.8, torch threads 2" -> "; torch threads 2"
    (_STAMP + r"[,;]\s+", ""),
    (r",?\s+load average \d+(?:\.\d+)? -> \d+(?:\.\d+)?", ""),
    # bench/CHOOSING.md's machine line: "optim 0.1.0 at commit 568a8c1 with uncommitted changes; 2026-12-02."
    (r"\s+at\s+commit\s+[0-9a-f]{7,40}(?:\s+with\s+uncommitted\s+changes)?", ""),
    (r";\s+\d{4}-\d\d-\d\d\.", "."),
    (r"\s+\(shared\s+with\s+other\s+work\s+while\s+measured\)", ""),
    (r"\s+shared\s+with\s+other\s+work\b", ""),
)


def scrub(text: str) -> str:
    """bench/*.md as a user reads it: what was measured, on what, and the numbers, without the commits each result
    measured, when it was measured and how loaded the machine was (tests/test_docs.py checks the built site)."""
    for pattern, repl in _SCRUB:
        text = re.sub(pattern, repl, text)
    return text


BENCH_INCLUDE = re.compile(r'^--8<-- "(?P<path>bench/[\w.-]+\.md)(?::(?P<section>[\w-]+))?"[ \t]*$', re.M)


def bench_include(m: re.Match) -> str:
    """A snippet line `--8<-- "bench/NAME.md:section"`: the section (the lines between its start and end markers,
    as the snippets extension reads them) or the whole file, scrubbed."""
    text = (ROOT / m["path"]).read_text()
    if m["section"]:
        start, end = (re.compile(rf"--8<-- \[{k}:{re.escape(m['section'])}\]") for k in ("start", "end"))
        lines = text.splitlines(keepends=True)
        first = next((i for i, line in enumerate(lines) if start.search(line)), None)
        last = next((i for i, line in enumerate(lines) if end.search(line) and i > (first or 0)), None)
        if first is None or last is None:
            raise ValueError(f"{m['path']} has no section {m['section']!r} (its start and end markers)")
        text = "".join(lines[first + 1 : last])
    return split_wide_tables(scrub(text)).rstrip("\n")


def on_page_markdown(markdown, page, **kwargs):
    # docs/changelog.md includes the repository's CHANGELOG.md with a snippet line, whose links to the docs are
    # written from the repository root (`docs/concepts/fused-kernel.md`). The include is done here, before
    # mkdocs checks the links, with those links made relative to the docs folder.
    include = '--8<-- "CHANGELOG.md"'
    if page.file.src_uri == "changelog.md" and include in markdown:
        changelog = (ROOT / "CHANGELOG.md").read_text()
        markdown = markdown.replace(include, re.sub(r"\]\(docs/", "](", changelog))
    if page.file.src_uri == "benchmarks.md" and BENCH_MARK in markdown:
        markdown = markdown.replace(BENCH_MARK, bench_results((ROOT / "bench" / "RESULTS.md").read_text()))
    return BENCH_INCLUDE.sub(bench_include, markdown)


TABLE = re.compile(r"<table>.*?</table>", re.S)
TABLE_CODE = re.compile(r"(<code>)(.*?)(</code>)", re.S)


def table_code_breaks(html: str) -> str:
    """`html` with a `<wbr>` after each `.`, `_`, `(`, `,` and `=` of the code inside its tables (not after a
    character entity's `;`, and not inside a tag)."""
    def code(m: re.Match) -> str:
        parts = re.split(r"(<[^>]*>|&[#\w]+;)", m.group(2))
        text = "".join(p if p.startswith(("<", "&")) else re.sub(r"([._(,=])(?=.)", r"\1<wbr>", p) for p in parts)
        return m.group(1) + text + m.group(3)
    return TABLE.sub(lambda t: TABLE_CODE.sub(code, t.group(0)), html)


IMAGE = re.compile(r"(<a\b[^>]*>\s*)?(<img\b[^>]*\bsrc=\"([^\"]+)\"[^>]*>)")


def image_links(html: str) -> str:
    """`html` with each image that is not in a link already wrapped in a link to its own file."""
    def link(m: re.Match) -> str:
        if m.group(1) or re.match(r"[a-z]+:", m.group(3)):   # in a link already; data: or another host
            return m.group(0)
        return f'<a class="image-link" href="{m.group(3)}">{m.group(2)}</a>'
    return IMAGE.sub(link, html)


def on_page_content(html, page, **kwargs):
    return image_links(table_code_breaks(html))

