"""The API reference (docs/api/*.md, rendered by mkdocstrings from the docstrings) reads well in the built site.

- Every line of a code box on an API page, the docstrings' examples and the rendered signatures alike, fits the
  code column: at most `MAX_CODE_COLUMNS` characters (tests/test_docs.py, measured at a 1280 px window: the
  column is 656 px inside its padding, 8.18 px a character of the 13.6 px monospace font; the API pages put their
  code in the same column, with no indentation of their own). A wider line is cut off behind a scrollbar. The
  signatures are wrapped by mkdocstrings (`separate_signature`, `line_length` in mkdocs.yml; it formats them
  with ruff, which the `docs` extra installs): without a formatter a signature is one line, Adafactor's 227
  characters.
- No API page names a private module (`optim._rules.moments`): a reader cannot import from it.
- Each object's source is on its page (`show_source`), collapsed; the source listing itself is exempt from the
  checks above (its lines are the code's, up to ruff's 120 characters, and it names the modules it imports).
- The rules page opens with a summary table, one row per public rule (a `Rule` subclass in `optim.__all__`):
  a new rule without a row fails here. Its formulas are MathML, typeset by the browser.
"""

from __future__ import annotations

import inspect
import re

import pytest
from test_docs import DOCS, MAX_CODE_COLUMNS, html_text, site_dir


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The built site, as tests/test_docs.py finds or builds it (one build for both files)."""
    return site_dir(tmp_path_factory)


PRE = re.compile(r"<pre\b[^>]*>(.*?)</pre>", re.S)
SIGNATURE = re.compile(r'<div class="doc-signature[^"]*">\s*<pre\b[^>]*>(.*?)</pre>', re.S)
SOURCE = re.compile(r'<details class="mkdocstrings-source">.*?</details>', re.S)


def api_pages(site):
    pages = sorted((site / "api").rglob("index.html"))
    assert len(pages) >= 9, f"{site / 'api'} holds {len(pages)} pages: is it the built site?"
    return pages


def read(page) -> str:
    """A built API page's HTML without its collapsed source listings."""
    return SOURCE.sub("", page.read_text())


def wide_lines(page, pattern) -> list[str]:
    return [f"{page.parent.name}: {len(line)} > {MAX_CODE_COLUMNS}: {line.strip()[:60]}..."
            for block in pattern.findall(read(page)) for line in html_text(block).splitlines()
            if len(line) > MAX_CODE_COLUMNS]


def test_api_code_lines_fit_the_column(built_site):
    wide = [hit for page in api_pages(built_site) for hit in wide_lines(page, PRE)]
    why = "API pages' code lines wider than the code column (rewrap the docstring's example):\n"
    assert wide == [], why + "\n".join(wide)


def test_api_signatures_are_wrapped_to_the_column(built_site):
    pages = api_pages(built_site)
    signatures = [s for page in pages for s in SIGNATURE.findall(read(page))]
    assert len(signatures) > 50, "mkdocs.yml: separate_signature shows each signature in its own code box"
    wide = [hit for page in pages for hit in wide_lines(page, SIGNATURE)]
    assert wide == [], "signatures wider than the code column (is ruff installed?):\n" + "\n".join(wide)
    adafactor = next(html_text(s) for s in signatures if html_text(s).startswith("Adafactor("))
    assert len(adafactor.splitlines()) > 5, adafactor


def test_api_pages_name_no_private_module(built_site):
    found = [f"{page.parent.name}: ...{m.group(0)}..." for page in api_pages(built_site)
             for m in re.finditer(r".{0,50}\boptim\._\w+.{0,20}", html_text(read(page)))]
    assert found == [], "API pages that name a private module (give the public name):\n" + "\n".join(found)


def test_api_pages_show_the_source(built_site):
    page = (built_site / "api" / "rules" / "index.html").read_text()
    assert len(SOURCE.findall(page)) == page.count('class="doc doc-object doc-class"') > 30
    assert "class Adam(" in html_text(page)


# ------------------------------------------------------------------------------------------------ the rules table
RULES_PAGE = DOCS / "api" / "rules.md"
# A row of a summary table: | [`Adam`][optim.Adam] | what it does | <math>...</math> | optax | PyTorch |
ROW = re.compile(r"^\| \[`(?P<name>\w+)`\]\[optim\.(?P=name)\] \|(?P<cells>.*)\|\s*$", re.M)


def public_rules() -> set[str]:
    import optim

    return {n for n in optim.__all__ if n != "Rule" and inspect.isclass(getattr(optim, n))
            and issubclass(getattr(optim, n), optim.Rule)}


def summary_rows(text: str) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for m in ROW.finditer(text):
        assert m["name"] not in rows, f"{m['name']}: two rows"
        rows[m["name"]] = [c.strip() for c in m["cells"].split("|")]
    return rows


def test_rules_page_has_one_summary_row_per_public_rule():
    text = RULES_PAGE.read_text()
    rows = summary_rows(text)
    assert sorted(rows) == sorted(public_rules()), (
        "docs/api/rules.md's summary tables: missing " + str(sorted(public_rules() - set(rows)))
        + ", not public rules " + str(sorted(set(rows) - public_rules())))
    first_directive = text.index("\n::: ")
    for name, cells in rows.items():
        what, formula, optax_, torch_ = cells   # one line of what it does, the step, the counterparts
        assert what and optax_ and torch_, name
        assert formula.startswith("<math>") and formula.endswith("</math>"), f"{name}: the step is not MathML"
        assert text.index(f"[`{name}`]") < first_directive, f"{name}: its row is not at the top of the page"


def test_the_summary_row_check_finds_a_rule_without_a_row():
    rows = summary_rows(RULES_PAGE.read_text())
    assert "Adam" in rows and "EMA" in rows
    removed = re.sub(r"^\| \[`Adam`\].*\n", "", RULES_PAGE.read_text(), flags=re.M)
    assert "Adam" not in summary_rows(removed) and "Adam" in public_rules()


def test_the_summary_table_is_typeset_in_the_built_page(built_site):
    page = (built_site / "api" / "rules" / "index.html").read_text()
    table = page[: page.index('class="doc doc-object')]
    assert table.count("<math") >= len(public_rules()) and table.count("<tr>") > len(public_rules())
    assert 'href="#optim.Adam"' in table and 'href="../wrappers/#optim.EMA"' in table
