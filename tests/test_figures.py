"""The docs' figures are fresh, and every picture the pages show is there.

`python -m bench.figures` draws the figures in docs/images/ from the results files in bench/ (and one tiny run of
its own, the tie drift). Each test here draws one again into a temporary folder and requires the committed PNG to
be the same file, byte for byte: a figure whose data (or drawing code) changed and that was not drawn again fails.
The figures are drawn with matplotlib's defaults, no metadata and rounded numbers (bench/figures.py says why), so
the same data gives the same bytes; a different matplotlib or Pillow could encode the same picture differently,
and the failure then says whether the pixels differ too.

The notebooks' pages and figures (docs/notebooks/, notebooks/rendered/, docs/images/notebooks/) are checked fresh
by tests/test_notebooks.py, which runs the notebooks.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from bench import figures  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
IMAGES = DOCS / "images"
FIGURES = figures.figures()


def _pixels_differ(a: bytes, b: bytes) -> str:
    import numpy as np
    from PIL import Image

    x, y = (np.asarray(Image.open(io.BytesIO(png)).convert("RGBA")) for png in (a, b))
    if x.shape != y.shape:
        return f"the sizes differ ({x.shape[1]}x{x.shape[0]} committed, {y.shape[1]}x{y.shape[0]} drawn now)"
    n = int((x != y).any(axis=-1).sum())
    return (f"{n} pixels differ" if n else
            "the pixels are the same, only the encoding differs (another matplotlib or Pillow?)")


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_figure_is_fresh(name, tmp_path):
    committed = IMAGES / name
    assert committed.exists(), f"docs/images/{name} is missing: run `python -m bench.figures`"
    FIGURES[name](tmp_path / name)
    now = (tmp_path / name).read_bytes()
    if now != committed.read_bytes():
        pytest.fail(f"docs/images/{name} is stale: {_pixels_differ(committed.read_bytes(), now)}; "
                    f"run `python -m bench.figures --only {name.removesuffix('.png')}`", pytrace=False)


def test_drawing_twice_gives_the_same_bytes(tmp_path):
    # What makes the freshness check meaningful: nothing but the data goes into the file.
    for k in (1, 2):
        figures.schedules(tmp_path / f"{k}.png")
    assert (tmp_path / "1.png").read_bytes() == (tmp_path / "2.png").read_bytes()
    assert b"Software" not in (tmp_path / "1.png").read_bytes()


# --------------------------------------------------------------------------------- the pages' images
IMAGE_REF = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)|<img\b[^>]*\bsrc=\"([^\"]+)\"")


def referenced_images() -> dict[Path, list[str]]:
    """Each image file a docs page shows -> the pages (and lines) that show it. The notebooks' rendered markdown
    (notebooks/rendered/NAME.md) is included by docs/notebooks/NAME.md, so its links are relative to that page."""
    sources = [(p, p.parent) for p in DOCS.rglob("*.md")]
    sources += [(p, DOCS / "notebooks") for p in (ROOT / "notebooks" / "rendered").glob("*.md")]
    refs: dict[Path, list[str]] = {}
    for path, base in sources:
        for k, line in enumerate(path.read_text().splitlines(), start=1):
            for m in IMAGE_REF.finditer(line):
                target = m[1] or m[2]
                if re.match(r"[a-z]+:", target):   # http:, data:
                    continue
                refs.setdefault((base / target).resolve(), []).append(f"{path.relative_to(ROOT)}:{k}")
    return refs


def test_every_image_a_page_shows_exists():
    missing = [f"{img.relative_to(ROOT) if img.is_relative_to(ROOT) else img} (from {', '.join(where)})"
               for img, where in referenced_images().items() if not img.is_file()]
    assert missing == [], "pages show images that are not there:\n" + "\n".join(missing)


def test_every_image_in_docs_is_shown():
    shown = set(referenced_images())
    unused = [str(p.relative_to(ROOT)) for p in sorted(IMAGES.rglob("*.png")) if p.resolve() not in shown]
    assert unused == [], "images no page shows (remove them, or show them):\n" + "\n".join(unused)


def test_every_figure_bench_draws_is_shown_and_the_gpu_chart_waits_for_gpu_results():
    shown = {p.name for p in referenced_images()}
    assert sorted(set(FIGURES) - shown) == []
    if not figures.GPU_RESULTS.exists():
        assert "bench-gpu-ratios.png" not in FIGURES
        assert "no GPU times are measured yet" in (DOCS / "benchmarks.md").read_text()
