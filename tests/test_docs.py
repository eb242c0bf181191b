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

What a block prints is shown on the page in an ```output block right after it (blank lines in between are
allowed), and the test compares: the block's stdout, trailing whitespace of each line and trailing blank lines
removed, must equal the output block's text. A block that prints and has no output block fails, and so does an
output block that follows no python block that ran. The outputs are written in the sources, not computed when the
site is built, so `mkdocs build` stays a few seconds (running every page takes ~40 s); tests/README.md says why.

No line of a code block (any language) is wider than the code column of the built site: `MAX_CODE_COLUMNS`
characters, the width measured at a 1280 px browser window (tests/README.md says how), so nothing is cut off at the
right of the column. Output blocks are exempt: they show what was printed, exactly, and the site wraps their long
lines (`docs/stylesheets/extra.css`).

The built site (build/site after `make test`'s `mkdocs build`, else built here) shows no bookkeeping on a user
page: no commit a result measured, measured-at stamp, machine load, test-file name or bare issue number
(`BOOKKEEPING`); those stay in bench/*.md and CHANGELOG.md, and docs/_ext/hooks.py scrubs what it includes.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NO_RUN = "<!-- docs: no-run -->"
MAX_NO_RUN = 8
# mkdocs-material at a 1280 px window: the code column is 656 px inside its padding, 8.18 px per character of the
# 13.6 px monospace font: 80 characters (tests/README.md, "Docs pages").
MAX_CODE_COLUMNS = 80

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


def _lines(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def following_outputs(text: str) -> dict[int, str | None]:
    """For each ```python fence (by line number): the text of the ```output block right after it, or None."""
    found = list(FENCE.finditer(text))
    out: dict[int, str | None] = {}
    for m, nxt in zip(found, found[1:] + [None]):
        if m["lang"] != "python":
            continue
        line = text.count("\n", 0, m.start()) + 1
        right_after = nxt is not None and nxt["lang"] == "output" and not text[m.end() : nxt.start()].strip()
        out[line] = textwrap.dedent(nxt["body"]) if right_after else None
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # The page's namespace is a module, as a session's __main__ is: a class defined on a page (a dataclass, a
    # rule) looks its module up in sys.modules.
    module = types.ModuleType(f"docs.{page.stem}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    scope: dict = module.__dict__
    text = page.read_text()
    expected = following_outputs(text)
    for line, lang, code, marked in blocks(text):
        if lang != "python" or marked:
            continue
        where = f"{page.relative_to(ROOT)}, the block at line {line}"
        stdout = io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout):
                exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), scope)
        except Exception as e:
            raise AssertionError(f"{where} failed: {e!r}") from e
        printed, shown = _lines(stdout.getvalue()), expected[line]
        if shown is None:
            assert not printed, f"{where} prints, and no ```output block follows it to show it:\n{printed}"
        else:
            assert printed == _lines(shown), f"{where} printed\n{printed}\nbut its output block shows\n{shown}"


def test_every_output_block_follows_a_python_block_that_runs():
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        runs = {line for line, lang, _, m in blocks(text) if lang == "python" and not m}
        outputs = sum(lang == "output" for _, lang, _, _ in blocks(text))
        attached = sum(shown is not None for line, shown in following_outputs(text).items() if line in runs)
        assert outputs == attached, f"{page.relative_to(ROOT)}: an ```output block after no python block that runs"


def test_no_code_line_is_wider_than_the_column():
    long = [
        f"{page.relative_to(ROOT)}:{line + i}: {len(row)} > {MAX_CODE_COLUMNS}: {row.strip()[:40]}..."
        for page in sorted(DOCS.rglob("*.md"))
        for line, lang, code, _ in blocks(page.read_text())
        if lang != "output"
        for i, row in enumerate(code.splitlines(), start=1)
        if len(row) > MAX_CODE_COLUMNS
    ]
    why = "code lines wider than the docs' code column (break them, move comments above):\n"
    assert long == [], why + "\n".join(long)


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
    # docs/_ext/hooks.py replaces the marker with the measured sections of bench/RESULTS.md at build time.
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_ext" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.BENCH_MARK in (DOCS / "benchmarks.md").read_text()
    shown = hooks.bench_results((ROOT / "bench" / "RESULTS.md").read_text())
    assert "## Summary" in shown and "Machine:" in shown
    for internal in ("Issue 5", "issue 14", "NOTES.md", "RULES.md", "PROGRAM.md", "(optim "):
        assert internal not in shown, internal
    assert bookkeeping(shown) == []
    # docs/guides/choosing.md's `--8<-- "bench/CHOOSING.md:results"`: included by the hook, scrubbed too.
    choosing = hooks.BENCH_INCLUDE.sub(hooks.bench_include, (DOCS / "guides" / "choosing.md").read_text())
    assert "--8<--" not in choosing and "| AdamW |" in choosing and "Machine:" in choosing
    assert bookkeeping(choosing) == []


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_ext" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_wide_results_tables_are_split_with_their_first_column():
    split = _hooks().split_wide_tables
    row = lambda *cells: "| " + " | ".join(cells) + " |\n"
    names = ["candidate", "step (ms)", "Mparam/s", "vs optax", "vs floor", "first call (s)", "peak RSS (MB)",
             "first call vs optax", "RSS vs optax", "state"]
    workload = row(*names) + row(*["---"] * 10) + row("optax", *map(str, range(9)))
    assert split("text\n\n" + workload + "\nmore") == (
        "text\n\n" + row(*names[:5]) + row(*["---"] * 5) + row("optax", "0", "1", "2", "3") + "\n"
        + row(names[0], *names[5:]) + row(*["---"] * 6) + row("optax", "4", "5", "6", "7", "8") + "\nmore")
    nine = row(*"abcdefghi") + row(*["---"] * 9)
    assert split(nine) == row(*"abcde") + row(*["---"] * 5) + "\n" + row(*"afghi") + row(*["---"] * 5)
    six = row(*"abcdef") + row(*["---"] * 6) + row(*"123456")
    assert split(six) == six


def test_benchmarks_page_counts_gpu_kernels_and_bytes_until_gpu_times_exist():
    """Until `python -m bench.gpu` has run on a GPU (bench/GPU.json), the page shows what a GPU step launches and
    moves, counted without a GPU (`python -m bench.kernels`), optim against optax."""
    if (ROOT / "bench" / "GPU.json").exists():
        pytest.skip("GPU times are measured: the page shows them")
    page = (DOCS / "benchmarks.md").read_text()
    assert "| step | kernels: optim / optax | MB: optim / optax | bytes a parameter: optim / optax / floor |" in page
    assert "| Adam | 131 / 150 | 3109 / 3108 | 28.0 / 28.0 / 28.0 |" in page


# ------------------------------------------------------------------------------------------ the built site
# A user page says what was measured, on what, and the numbers: the repository's bookkeeping (the commit a result
# measured, when and on how loaded a machine, which test file checks a claim, the project's issue numbers) stays in
# bench/*.md and CHANGELOG.md. docs/_ext/hooks.py scrubs what it includes from bench/; this reads the built site.
SITE = ROOT / "build" / "site"   # where `make test` builds it (mkdocs build --strict --site-dir build/site)
SITE_SOURCES = ("docs", "optim", "bench", "mkdocs.yml", "CHANGELOG.md", "examples", "notebooks")
SITE_SUFFIXES = {".md", ".py", ".yml", ".css", ".png", ".svg", ".js", ".jinja"}
NOT_USER_PAGES = {"changelog/index.html", "404.html"}   # the changelog keeps its commits and issue numbers
_HASH = r"(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
BOOKKEEPING = {
    "a commit": re.compile(rf"\bcommit(?:ted)?\b\W+(?:\w+\W+){{0,2}}?{_HASH}|\b{_HASH}\W+commit|\boptim {_HASH}"
                           r"|uncommitted changes|\+dirty\b", re.I),
    "a test file": re.compile(r"\btests/test_\w+|\btest_\w+\.py\b"),
    "an issue number": re.compile(r"\(#\d+\)|\bissue #?\d+\b", re.I),
    "the machine's load": re.compile(r"load average|machine was busy|busy machine|shared with other work"
                                     r"|other jobs on the machine", re.I),
    "a run history": re.compile(r"\blatest run\b|\bthe one before\b|\bchanges often\b", re.I),
    "a measured-at stamp": re.compile(r"\b\d{4}-[01]\d-[0-3]\d\b|\b\d\d:\d\d UTC\b"),
}


def bookkeeping(text: str) -> list[str]:
    """What kind of bookkeeping the text holds, each hit with some words around it (whitespace collapsed)."""
    text = re.sub(r"\s+", " ", text)
    return [f"{kind}: ...{text[max(0, m.start() - 50) : m.end() + 30]}..."
            for kind, pattern in BOOKKEEPING.items() for m in pattern.finditer(text)]


def html_text(page: str) -> str:
    """The text a reader sees on a built page (code included), without scripts, styles and tags."""
    import html

    page = re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.S | re.I)
    return html.unescape(re.sub(r"<[^>]+>", "", page))


_BUILT_HERE: list[pathlib.Path] = []   # a site this test run built: one build for every module that asks


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> pathlib.Path:
    return site_dir(tmp_path_factory)


def site_dir(tmp_path_factory) -> pathlib.Path:
    """The built docs site: build/site when it is newer than everything it is built from (after `make test`'s
    `mkdocs build`), else built here into a temporary folder, once per test run (tests/test_api_docs.py's
    fixture calls this too)."""
    index = SITE / "index.html"
    sources = [p for s in SITE_SOURCES for p in [ROOT / s, *(ROOT / s).rglob("*")]
               if p.suffix in SITE_SUFFIXES and "__pycache__" not in p.parts]
    newest = max(p.stat().st_mtime for p in sources)
    if index.exists() and index.stat().st_mtime > newest:
        return SITE
    if _BUILT_HERE:
        return _BUILT_HERE[0]
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    site = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stderr[-4000:]}"
    _BUILT_HERE.append(site)
    return site


def test_the_bookkeeping_check_finds_what_it_should():
    for planted in ("optim 0.1.0 at commit 568a8c1 with uncommitted changes", "(optim 609b3bf)",
                    "checked by tests/test_fused.py", "in that form (#211)", "measured 2026-12-03 19:13 UTC",
                    "load average 1.5 -> 1.8", "the first figure is the latest run, the second the one before",
                    "each section names the optim\ncommit it measured; the repository changes often"):
        assert bookkeeping(planted), planted
    for fine in ("(Optimisers.jl #211)", "an uncommitted scalar on the default device", "`optim.save` commits",
                 "1.0 is as fast as optax", "the test suite checks it", "(4096, 4096) float32, 15 rounds"):
        assert not bookkeeping(fine), (fine, bookkeeping(fine))


def test_the_site_loads_nothing_from_elsewhere(built_site):
    """No font, stylesheet or script from another host (mkdocs-material's default fetches Roboto from a font
    CDN: offline, or behind a firewall, a page load waits on it); papers and projects are plain links."""
    pages = sorted(built_site.rglob("*.html"))
    loads = re.compile(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="(?:https?:)?//[^"]*"')
    found = [f"{p.relative_to(built_site)}: {m.group(0)}" for p in pages for m in loads.finditer(p.read_text())]
    assert found == [], "\n".join(found[:20])
    assert "fonts.googleapis" not in "".join(p.read_text() for p in built_site.rglob("*.css"))


def test_no_bookkeeping_on_user_pages(built_site):
    pages = sorted(built_site.rglob("*.html"))
    assert len(pages) > 20, f"{built_site} holds {len(pages)} pages: is it the built site?"
    found = [f"{p.relative_to(built_site)}: {hit}" for p in pages
             if str(p.relative_to(built_site)) not in NOT_USER_PAGES for hit in bookkeeping(html_text(p.read_text()))]
    assert found == [], "bookkeeping on user pages (keep it in bench/*.md and CHANGELOG.md):\n" + "\n".join(found)


# ------------------------------------------------------------------------------- the built site's layout
# What a reader at a 1280 px window sees of each page, measured on the built HTML (tests/README.md, "Docs pages").
# A table of more than MAX_TABLE_COLUMNS columns hides its right-hand columns behind a sideways scrollbar: the theme
# gives each header cell at least 5rem, so 7 columns need 771 px where the column has 720 (Chromium);
# docs/_ext/hooks.py splits the results tables.
MAX_TABLE_COLUMNS = 6


def table_columns(page_html: str) -> list[int]:
    """The number of columns of each table of a page (the cells of its first row)."""
    tables = re.findall(r"<table\b.*?</table>", page_html, re.S)
    return [len(re.findall(r"<t[hd]\b", re.search(r"<tr\b.*?</tr>", t, re.S).group(0))) for t in tables]


def test_no_table_on_a_built_page_has_more_columns_than_fit(built_site):
    wide = [f"{p.relative_to(built_site)}: a table of {n} columns" for p in sorted(built_site.rglob("*.html"))
            for n in table_columns(p.read_text()) if n > MAX_TABLE_COLUMNS]
    assert wide == [], f"tables wider than {MAX_TABLE_COLUMNS} columns on the built site:\n" + "\n".join(wide)
    assert max(table_columns((built_site / "benchmarks" / "index.html").read_text())) >= 5


def test_the_table_check_counts_columns():
    assert table_columns("<table><thead><tr><th>a</th><th>b</th></tr></thead><tr><td>1</td><td>2</td></tr>"
                         "</table><p></p><table><tr><td>1</td></tr></table>") == [2, 1]


def test_every_figure_on_a_built_page_opens_its_image(built_site):
    """The figures are drawn at twice the column's width: a click opens the image at full size
    (docs/_ext/hooks.py)."""
    unlinked = []
    for p in sorted(built_site.rglob("*.html")):
        page = p.read_text()
        for m in re.finditer(r'<img\b[^>]*\bsrc="([^"]+\.png)"[^>]*>', page):
            if not re.search(r'<a\b[^>]*\bhref="' + re.escape(m[1]) + r'"[^>]*>\s*$', page[: m.start()]):
                unlinked.append(f"{p.relative_to(built_site)}: {m[1]}")
    assert unlinked == [], "figures a click does not open:\n" + "\n".join(unlinked)
    assert "images/bench-cpu-ratios.png" in (built_site / "benchmarks" / "index.html").read_text()


# A code line wider than MAX_CODE_COLUMNS is cut off at the column's right, wherever it comes from: the notebooks'
# pages include notebooks/rendered/, the benchmarks page bench/'s results.
PRE_BLOCK = re.compile(r"<pre\b[^>]*>(.*?)</pre>", re.S)
# An ```output block: Pygments marks its lines .go (docs/stylesheets/extra.css wraps its long lines).
OUTPUT_BLOCK = re.compile(r'^(?:<span></span>)?<code>\s*<span class="go">')
# Code the site wraps rather than cuts off, each with why it keeps its width: the source listings of the API pages
# (collapsed; the code's own lines, up to ruff's 120 columns) and the examples page's whole files (examples/*.py,
# at the repository's 120 columns).
WRAPPED_CODE = {
    "mkdocstrings source listings": re.compile(r'<details class="mkdocstrings-source">.*?</details>', re.S),
    "the examples page's whole files": re.compile(r'<div class="wrap-code"[^>]*>.*?</pre>', re.S),
}


def code_lines_over(page_html: str, columns: int) -> list[str]:
    """The lines over `columns` characters of the page's code blocks, output blocks and WRAPPED_CODE left out."""
    for pattern in WRAPPED_CODE.values():
        page_html = pattern.sub("", page_html)
    return [line for block in PRE_BLOCK.findall(page_html) if not OUTPUT_BLOCK.match(block)
            for line in html_text(block).splitlines() if len(line) > columns]


def test_no_code_line_on_a_built_page_is_wider_than_the_column(built_site):
    wide = [f"{p.relative_to(built_site)}: {len(line)} > {MAX_CODE_COLUMNS}: {line.strip()[:60]}"
            for p in sorted(built_site.rglob("*.html")) for line in code_lines_over(p.read_text(), MAX_CODE_COLUMNS)]
    assert wide == [], "code lines wider than the code column on the built site:\n" + "\n".join(wide)


def test_the_code_line_check_finds_what_it_should():
    code = '<pre><span></span><code>{}</code></pre>'
    assert code_lines_over(code.format("x" * 81), 80) == ["x" * 81]
    assert code_lines_over(code.format("x" * 80 + "\n&lt;" + "y" * 79), 80) == []
    assert code_lines_over(code.format('<span class="go">' + "x" * 90 + "</span>"), 80) == []
    assert code_lines_over('<div class="wrap-code" markdown>' + code.format("x" * 90), 80) == []

# What headless Chromium lays out at a 1280 px window: no table and no code block scrolls sideways, no code line
# runs under a code block's copy button. Optional: skipped where Chromium is not installed (CI has none).
LAYOUT_PAGES = ("index.html", "benchmarks/index.html", "concepts/ties/index.html", "concepts/internals/index.html",
                "guides/low-memory/index.html", "notebooks/02_tied_weights/index.html", "api/rules/index.html")
LAYOUT_SCRIPT = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const found = [];
  document.querySelectorAll(".md-typeset__scrollwrap, .md-typeset__table").forEach(t => {
    const head = [...t.querySelectorAll("th")].map(h => h.textContent).join(" | ").slice(0, 60);
    if (t.scrollWidth > t.clientWidth + 1) found.push(`a table scrolls (${t.clientWidth} px): ${head}`);
  });
  document.querySelectorAll(".md-typeset pre > code").forEach(code => {
    if (!code.clientWidth) return;   // not shown (a collapsed source listing)
    const head = code.textContent.split("\\n")[0].slice(0, 40);
    if (code.scrollWidth > code.clientWidth + 1) found.push(`code scrolls: ${head}`);
    const nav = code.parentElement.querySelector(".md-code__nav");
    if (!nav) return;
    const b = nav.getBoundingClientRect(), range = document.createRange();
    range.selectNodeContents(code);
    for (const r of range.getClientRects())
      if (r.width && r.bottom > b.top && r.top < b.bottom && r.right > b.left && r.left < b.right) {
        found.push(`text under the copy button: ${head}`); break;
      }
  });
  const out = document.createElement("pre");
  out.id = "layout-check"; out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
}, 500));
</script>"""


def _chromium() -> str | None:
    import shutil

    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


@pytest.mark.skipif(_chromium() is None, reason="no Chromium on this machine")
def test_layout_at_1280_px_in_chromium(built_site, tmp_path):
    import html
    import json
    import shutil

    site = tmp_path / "site"
    shutil.copytree(built_site, site)
    found = []
    for name in LAYOUT_PAGES:
        page = site / name
        check = page.with_name("layout-check.html")
        check.write_text(page.read_text().replace("</body>", LAYOUT_SCRIPT + "</body>"))
        r = subprocess.run([_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
                            "--virtual-time-budget=5000", "--dump-dom", check.as_uri()],
                           capture_output=True, text=True, timeout=120)
        m = re.search(r'<pre id="layout-check">(.*?)</pre>', r.stdout, re.S)
        assert m, f"{name}: Chromium gave no measurement:\n{r.stderr[-2000:]}"
        found += [f"{name}: {f}" for f in json.loads(html.unescape(m[1]))]
    assert found == [], "at a 1280 px window:\n" + "\n".join(found)
