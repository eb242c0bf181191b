"""Execute every notebook in notebooks/ top to bottom; any error in any cell fails the test.

The kernel is this interpreter (a kernelspec written to a temporary folder), so the notebooks see the optim
installed in the test environment, whatever Jupyter kernels the machine has. The committed notebooks are read,
never written back (their outputs stay cleared).

The docs site shows each notebook with its outputs (docs/notebooks/, written by `python docs/_ext/notebooks.py`,
which runs them the same way: `kernel_spec`, `RUNNER` and `execute` are that script's). Each run here is rendered
again and compared with the committed page and figures, so a notebook changed without running the script fails.
The comparison does not depend on this CPU's rounding (`nbdocs.differences`, whose comment gives the measurements):
code and text exactly, printed numbers within `nbdocs.RTOL` (6%; another CPU moved the quickstart's printed loss by
1.4%), figures by what they draw, never by their pixels: the same titles, labels and legends, as many arrays and
points, each value on a linear axis within `nbdocs.LINEAR` (4%) of its array's range, and on a log axis the
quantiles within `nbdocs.LOG` (0.3) of their range in decades (the quickstart's training loss moves by two decades
at single steps on another CPU).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("docs_notebooks", ROOT / "docs" / "_ext" / "notebooks.py")
nbdocs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nbdocs)


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory) -> str:
    """A folder of kernelspecs holding one: this interpreter's."""
    return nbdocs.kernel_spec(tmp_path_factory.mktemp("kernels"))


def test_notebooks_exist():
    names = {p.name for p in PATHS}
    for want in ("01_quickstart.ipynb", "02_tied_weights.ipynb", "03_freeze_and_finetune.ipynb",
                 "04_data_parallel.ipynb"):
        assert want in names


def test_code_cells_fit_the_docs_column():
    """The notebooks' pages show their code in the docs' code column, 80 characters at a 1280 px window
    (tests/test_docs.py's MAX_CODE_COLUMNS); wider, a line is cut off. Formatted with `ruff format --line-length 80`;
    a comment too long is continued on a line of its own, with its `#`."""
    wide = [f"{path.name}, cell {k}: {len(line)} > 80: {line.strip()[:50]}..."
            for path in PATHS for k, cell in enumerate(nbformat.read(path, as_version=4).cells)
            if cell.cell_type == "code" for line in cell.source.splitlines() if len(line) > 80]
    assert wide == [], "notebook code lines wider than the docs' code column:\n" + "\n".join(wide)


def test_every_notebook_has_a_page_in_the_site():
    nav = (ROOT / "mkdocs.yml").read_text()
    for path in PATHS:
        assert f"notebooks/{path.stem}.md" in nav, f"mkdocs.yml's nav does not list notebooks/{path.stem}.md"
    for folder in (nbdocs.PAGES, nbdocs.RENDERED):
        assert {p.stem for p in folder.glob("*.md")} == {p.stem for p in PATHS}, \
            f"{folder.relative_to(ROOT)}: pages of notebooks that are gone, or not rendered yet"


def test_each_committed_figure_is_the_one_its_data_was_recorded_with():
    for path in PATHS:
        records = json.loads((nbdocs.RENDERED / f"{path.stem}.json").read_text())
        pngs = {p.name: p.read_bytes() for p in nbdocs.IMAGES.glob(f"{path.stem}-*.png")}
        assert set(records) == set(pngs), path.stem
        for file, record in records.items():
            assert hashlib.sha256(pngs[file]).hexdigest() == record["sha256"], file
            assert record["data"]["axes"], file


def test_another_cpus_rounding_passes_and_a_change_fails():
    same = nbdocs.text_differences
    assert same("loss: 0.037760004", "loss: 0.037233267") == []     # 1.4%: an AMD EPYC against the committed page
    assert same("loss: 0.037760004", "loss: 0.041") != []           # 8.6%
    assert same("max 3.6e-07", "max 1.2e-06") == []                 # rounding errors: within ATOL
    assert same("lr=0.01", "lr=0.02") != [] and same("x = 1", "y = 1") != []
    curve = [0.83, 0.1, 0.02, 3e-3, 1e-3, 1e-4, 1e-5]                # a loss on a log axis, 4.9 decades

    def log_axis(values):
        return {"y": nbdocs.drawn_array(values, log=True)}

    want, differ = log_axis(curve), nbdocs.data_differences
    assert differ(want, log_axis([0.83, 0.1, 0.2, 3e-3, 2e-3, 2e-4, 2e-5])) == []
    assert differ(want, log_axis([0.83, 0.6, 0.5, 0.4, 0.3, 0.3, 0.3])) != []             # no training
    assert differ(want, log_axis(curve[:-1] + [float("nan")])) != []                    # a point not drawn
    assert differ(want, log_axis(curve[:-1])) != []                                     # one point fewer
    lr = [0.03 * t / 50 for t in range(50)] + [0.03 * (1 + math.cos(math.pi * t / 550)) / 2 for t in range(550)]
    want = {"y": nbdocs.drawn_array(lr)}                                     # a schedule on a linear axis
    assert differ(want, {"y": nbdocs.drawn_array([v * (1 + 1e-4) for v in lr])}) == []
    assert differ(want, {"y": nbdocs.drawn_array(lr[:50] + [0.03 * (1 + math.cos(math.pi * (t / 550) ** 2)) / 2
                                                            for t in range(550)])}) != []
    assert differ({"title": "loss after 200 steps"}, {"title": "loss after 300 steps"}) != []


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, kernel_specs, tmp_path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"{path.name}: commit notebooks with outputs cleared"
    executed = tmp_path / path.name
    r, got = nbdocs.execute(path, kernel_specs, executed)
    assert r.returncode == 0, f"{path.name}: the notebook runner failed ({r.returncode}):\n{r.stderr[-4000:]}"
    if got["error"] is not None:
        pytest.fail(f"{path.name}: a cell failed:\n" + got["error"], pytrace=False)
    assert got["seconds"] < 180, f"{path.name} took {got['seconds']:.0f} s (it should run in well under a minute)"
    # Every notebook shows at least one picture.
    assert got["images"] >= 1, f"{path.name}: no plot was produced"
    # The page the docs site shows is this run's (within another CPU's rounding: nbdocs.differences).
    stale = nbdocs.differences(path.stem, *nbdocs.render(nbformat.read(executed, as_version=4), path.stem))
    assert stale == [], (f"the docs page of {path.name} is stale: run `python docs/_ext/notebooks.py {path.stem}`\n"
                         + "\n".join(stale))
