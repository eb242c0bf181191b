"""mkdocs hooks of the docs site (mkdocs.yml, `hooks:`).

- The header shows optim's version: `site_name` becomes "optim 0.1.0", read from `optim/__init__.py` (the one place
  the version is written) without importing the package.
- The benchmarks page shows the measured sections of bench/RESULTS.md (`bench_results`).
- The changelog page includes CHANGELOG.md, its links to `docs/...` made relative to the docs folder.
- Maths is MathML written in the pages (`<math>`), which browsers typeset themselves: nothing to load, offline.
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
    out = "\n\n".join(keep)
    out = re.sub(r" Each section names the optim commit it measured;[^.]*\.", "", out)
    return re.sub(r" \(optim [0-9a-f]{7,40}\)", "", out)


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
    return markdown
