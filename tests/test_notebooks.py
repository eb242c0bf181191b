"""Execute every notebook in notebooks/ top to bottom; any error in any cell fails the test.

The kernel is this interpreter (a kernelspec written to a temporary folder), so the notebooks see the optim
installed in the test environment, whatever Jupyter kernels the machine has. The committed notebooks are read,
never written back (their outputs stay cleared).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
KERNEL = "optim-test-python"


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kernels")
    spec = root / KERNEL
    spec.mkdir()
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "optim tests", "language": "python",
        "env": {"MPLBACKEND": "module://matplotlib_inline.backend_inline", "PYTHONWARNINGS": "ignore"},
    }))
    return KernelSpecManager(kernel_dirs=[str(root)], ensure_native_kernel=False)


def test_notebooks_exist():
    names = {p.name for p in PATHS}
    for want in ("01_quickstart.ipynb", "02_tied_weights.ipynb", "03_freeze_and_finetune.ipynb",
                 "04_data_parallel.ipynb"):
        assert want in names


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, kernel_specs):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"{path.name}: commit notebooks with outputs cleared"
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=kernel_specs)
    client = nbclient.NotebookClient(nb, km=km, timeout=240, allow_errors=False,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    t = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell failed:\n" + re.sub(r"\x1b\[[0-9;]*m", "", str(e)), pytrace=False)
    seconds = time.perf_counter() - t
    assert seconds < 180, f"{path.name} took {seconds:.0f} s (it should run in well under a minute)"
    # Every notebook shows at least one picture.
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images >= 1, f"{path.name}: no plot was produced"
