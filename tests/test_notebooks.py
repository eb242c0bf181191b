"""Execute every notebook in notebooks/ top to bottom; any error in any cell fails the test.

The kernel is this interpreter (a kernelspec written to a temporary folder), so the notebooks see the optim
installed in the test environment, whatever Jupyter kernels the machine has. The committed notebooks are read,
never written back (their outputs stay cleared).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
KERNEL = "optim-test-python"


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory) -> str:
    """A folder of kernelspecs holding one: this interpreter's."""
    root = tmp_path_factory.mktemp("kernels")
    spec = root / KERNEL
    spec.mkdir()
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "optim tests", "language": "python",
        "env": {"MPLBACKEND": "module://matplotlib_inline.backend_inline", "PYTHONWARNINGS": "ignore"},
    }))
    return str(root)


def test_notebooks_exist():
    names = {p.name for p in PATHS}
    for want in ("01_quickstart.ipynb", "02_tied_weights.ipynb", "03_freeze_and_finetune.ipynb",
                 "04_data_parallel.ipynb"):
        assert want in names


# Each notebook runs in a child process: nbclient leaves its kernel client's channel threads (and their ZMQ
# sockets) alive in the process that executed the notebook, and they would stay for the rest of the test session.
RUNNER = r"""
import json, re, sys, time
import nbclient, nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

path, kernels, name, folder = sys.argv[1:5]
nb = nbformat.read(path, as_version=4)
km = KernelManager(kernel_name=name,
                   kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernels], ensure_native_kernel=False))
client = nbclient.NotebookClient(nb, km=km, timeout=600, allow_errors=False, resources={"metadata": {"path": folder}})
t = time.perf_counter()
error = None
try:
    client.execute()
except nbclient.exceptions.CellExecutionError as e:
    error = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
print(json.dumps({"error": error, "seconds": time.perf_counter() - t, "images": images}))
"""


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, kernel_specs):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"{path.name}: commit notebooks with outputs cleared"
    r = subprocess.run([sys.executable, "-c", RUNNER, str(path), kernel_specs, KERNEL, str(NOTEBOOKS)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{path.name}: the notebook runner failed ({r.returncode}):\n{r.stderr[-4000:]}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if got["error"] is not None:
        pytest.fail(f"{path.name}: a cell failed:\n" + got["error"], pytrace=False)
    assert got["seconds"] < 180, f"{path.name} took {got['seconds']:.0f} s (it should run in well under a minute)"
    # Every notebook shows at least one picture.
    assert got["images"] >= 1, f"{path.name}: no plot was produced"
