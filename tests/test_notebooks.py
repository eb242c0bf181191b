"""Execute every notebook in notebooks/ top to bottom; any error in any cell fails the test.

The kernel is this interpreter (a kernelspec written to a temporary folder), so the notebooks see the optim
installed in the test environment, whatever Jupyter kernels the machine has. The committed notebooks are read,
never written back (their outputs stay cleared).

The docs site shows each notebook with its outputs (docs/notebooks/, written by `python docs/_ext/notebooks.py`,
which runs them the same way: `kernel_spec`, `RUNNER` and `execute` are that script's). Each run here is rendered
again and compared with the committed page and figures, so a notebook changed without running the script fails.
"""

from __future__ import annotations

import importlib.util
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


def test_every_notebook_has_a_page_in_the_site():
    nav = (ROOT / "mkdocs.yml").read_text()
    for path in PATHS:
        assert f"notebooks/{path.stem}.md" in nav, f"mkdocs.yml's nav does not list notebooks/{path.stem}.md"
    for folder in (nbdocs.PAGES, nbdocs.RENDERED):
        assert {p.stem for p in folder.glob("*.md")} == {p.stem for p in PATHS}, \
            f"{folder.relative_to(ROOT)}: pages of notebooks that are gone, or not rendered yet"


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
    # The page the docs site shows is this run's (within a run's rounding).
    stale = nbdocs.differences(path.stem, *nbdocs.render(nbformat.read(executed, as_version=4), path.stem))
    assert stale == [], (f"the docs page of {path.name} is stale: run `python docs/_ext/notebooks.py {path.stem}`\n"
                         + "\n".join(stale))
