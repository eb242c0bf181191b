"""The docs' figures are fresh, and every picture the pages show is there.

`python -m bench.figures` draws the figures in docs/images/ from the results files in bench/ and from two small
computations of its own (the schedules, the tie drift). No check here depends on this CPU's floating point:

- a figure read from results files is drawn again from them and must be the committed PNG byte for byte (what it
  draws is computed the same on every machine: bench/figures.py says how);
- a computed figure's data is computed again and compared with what the committed PNG drew (recorded in
  bench/FIGURES.json) within the figure's tolerance: another CPU rounds float32 differently (an AMD EPYC drew
  the tie drift 44 pixels apart from the figure first committed). Then the recorded data is drawn again and must
  be the committed PNG byte for byte.

So a figure whose data or drawing code changed and that was not drawn again fails. The figures are drawn with
matplotlib's defaults, no metadata and rounded numbers, so the same data gives the same bytes; a different
matplotlib or Pillow could encode the same picture differently, and the failure then says whether the pixels
differ too.

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
    run = f"run `python -m bench.figures --only {name.removesuffix('.png')}`"
    assert committed.exists(), f"docs/images/{name} is missing: {run}"
    figure = FIGURES[name]
    data = figure.data()
    if figure.tolerance is not None:
        recorded = figures.records().get(name)
        assert recorded is not None, f"bench/FIGURES.json has no data of {name}: {run}"
        moved = figures.close(recorded, data, *figure.tolerance)
        if moved:
            pytest.fail(f"docs/images/{name} is stale: {len(moved)} of the numbers it draws moved by more than "
                        f"rtol, atol = {figure.tolerance}:\n" + "\n".join(moved[:10]) + f"\n{run}", pytrace=False)
        data = recorded
    figure.draw(data, tmp_path / name)
    now = (tmp_path / name).read_bytes()
    if now != committed.read_bytes():
        what = "drawn from its data" if figure.tolerance is None else "drawn from its recorded data"
        pytest.fail(f"docs/images/{name} is stale: it is not the picture {what} by bench/figures.py "
                    f"({_pixels_differ(committed.read_bytes(), now)}); {run}", pytrace=False)


def test_the_records_are_the_computed_figures():
    computed = {name for name, f in FIGURES.items() if f.tolerance is not None}
    assert computed == {"schedules.png", "tie-drift.png"}
    assert set(figures.records()) == computed, "bench/FIGURES.json: run `python -m bench.figures`"


def test_a_moved_number_is_caught_within_tolerance_and_beyond_it():
    rtol, atol = figures.TIE_DRIFT_TOLERANCE
    want = {"a": [1.0, 0.0, -2.0], "b": "x"}
    assert figures.close(want, {"a": [1 + rtol / 2, atol / 2, -2.0], "b": "x"}, rtol, atol) == []
    far = 1 + 3 * rtol
    assert figures.close(want, {"a": [far, 0.0, -2.0], "b": "x"}, rtol, atol) == [f"['a'][0]: 1.0 recorded, {far} now"]
    assert figures.close(want, {"a": [1.0, 0.0, -2.0], "b": "y"}, rtol, atol) == ["['b']: 'x' recorded, 'y' now"]
    assert figures.close(want, {"a": [1.0, 0.0], "b": "x"}) == ["['a']: 3 values recorded, 2 now"]


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


# ------------------------------------------------------------------------------------- drawn for the column
# The content column is about 690 px wide at a 1280 px window (tests/README.md, "Docs pages"): a wider image is
# shown scaled down to it. Drawn for full-width pages (1144-1490 px), the figures' legends and value labels were
# about 6 px high there; the body text is 16 px and code 13.6 px. bench/figures.py draws at twice the column's
# width (a click opens the full size), the notebooks at the column's width (the inline backend's 100 dpi).
COLUMN_PX = 690
MAX_WIDTH_PX = 1400
MIN_TEXT_PX = 12


def _png_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def test_every_image_is_drawn_for_the_column():
    too_wide = [f"{p.relative_to(ROOT)}: {_png_size(p)[0]} px" for p in sorted(IMAGES.rglob("*.png"))
                if _png_size(p)[0] > MAX_WIDTH_PX]
    assert too_wide == [], f"images wider than {MAX_WIDTH_PX} px (about twice the column):\n" + "\n".join(too_wide)
    notebooks = [f"{p.name}: {_png_size(p)[0]} px" for p in sorted((IMAGES / "notebooks").glob("*.png"))
                 if _png_size(p)[0] > COLUMN_PX]
    assert notebooks == [], "notebook figures wider than the column (one panel a row, figsize 6.4 in or less):\n" \
        + "\n".join(notebooks)


def test_bench_figures_text_is_readable_in_the_column(tmp_path, monkeypatch):
    """Every text of every figure bench/figures.py draws (titles, labels, ticks, legends, value labels) is at
    least MIN_TEXT_PX high as the page shows it: its size at the figure's dpi, scaled to the column."""
    import matplotlib.figure
    import matplotlib.text

    smallest: dict[str, tuple[float, str]] = {}
    save = matplotlib.figure.Figure.savefig

    def measure(fig, path, *args, **kwargs):
        fig.canvas.draw()   # the tick labels exist once drawn
        dpi = kwargs.get("dpi", fig.dpi)
        shown = min(1.0, COLUMN_PX / (fig.get_figwidth() * dpi))
        texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
        smallest[Path(path).name] = min((t.get_fontsize() * dpi / 72 * shown, t.get_text()) for t in texts)
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", measure)
    recorded = figures.records()
    for name, figure in FIGURES.items():
        figure.draw(recorded[name] if figure.tolerance is not None else figure.data(), tmp_path / name)
    assert set(smallest) == set(FIGURES)
    small = [f"{name}: {px:.1f} px ({text!r})" for name, (px, text) in smallest.items() if px < MIN_TEXT_PX]
    assert small == [], f"texts under {MIN_TEXT_PX} px in the column:\n" + "\n".join(small)
