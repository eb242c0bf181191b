"""The distribution: `python -m build` makes an sdist and a wheel, and the wheel works installed on its own.

The build runs on a copy of the work tree in a temporary folder (what `git ls-files` lists, committed or not),
so no `build/` or `*.egg-info` appears in the repository. The wheel is built from the sdist (what
`python -m build` does when asked for neither alone), so a file missing from the sdist shows too.

The wheel is then installed into a fresh virtual environment, and a smoke test runs there from a temporary
folder, in isolated mode (`python -I`: no `PYTHONPATH`, no current folder on `sys.path`): import, version,
`py.typed`, and the README's tie example read from README.md now. So that jax is not downloaded on every
run, the fresh environment sees the test environment's installed packages through a `.pth` file that names
their site-packages folder. A folder named in a `.pth` file is added to `sys.path`, but the `.pth` files inside
it are not run, so the test environment's editable install of optim (an `__editable__*.pth` that installs an
import finder pointing at the source tree) stays off; the smoke test checks that optim came from the new
environment all the same.
"""

from __future__ import annotations

import ast
import os
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("build")

ROOT = Path(__file__).resolve().parents[1]
DIST_NAME = "optim-jax"
PROJECT = "optim_jax"   # the distribution name as it appears in file names


def _source_version() -> str:
    """The version literal in optim/__init__.py, the one place it is written."""
    for node in ast.parse((ROOT / "optim" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("optim/__init__.py has no __version__ = '...' literal")


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _tie_block() -> str:
    """The first python block under the README heading '## The tie problem in ten lines'."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The tie problem in ten lines", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist and wheel of a copy of the work tree, in a temporary folder."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git work tree: the build copies what `git ls-files` lists")
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    listed = _run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT)
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    out = tmp / "dist"
    # --no-isolation: build with this environment's setuptools (the test extra has setuptools>=77 and build),
    # instead of downloading setuptools into a new environment on every run.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)], cwd=tmp)
    return out


def _one(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {dist}, found {[p.name for p in found]}"
    return found[0]


def _modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "optim").rglob("*.py")}


def test_version_is_written_once_and_is_the_distributions():
    import optim

    assert optim.__version__ == _source_version()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M)
    assert 'version = {attr = "optim.__version__"}' in pyproject
    assert not re.search(r"^version\s*=", pyproject.split("[tool.setuptools.dynamic]")[0], re.M)


def test_sdist_has_the_package_the_marker_and_the_license(dist):
    sdist = _one(dist, f"{PROJECT}-*.tar.gz")
    top = f"{PROJECT}-{_source_version()}"
    assert sdist.name == f"{top}.tar.gz"
    with tarfile.open(sdist) as t:
        names = {n.removeprefix(top + "/") for n in t.getnames()}
    assert {"optim/py.typed", "LICENSE", "README.md", "pyproject.toml"} <= names
    assert _modules() <= names, sorted(_modules() - names)


def test_wheel_has_the_package_the_marker_and_the_metadata(dist):
    wheel = _one(dist, f"{PROJECT}-*.whl")
    version = _source_version()
    # A wheel for this interpreter and platform: it holds the fused CPU kernel, compiled by setup.py.
    tag = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert wheel.name == f"{PROJECT}-{version}-{py}-{py}-{tag}.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(f"{PROJECT}-{version}.dist-info/METADATA").decode()
    assert "optim/py.typed" in names
    assert [n for n in names if n.startswith("optim/_engine/_fused_kernel") and n.endswith(".so")], sorted(names)
    assert _modules() <= names, sorted(_modules() - names)
    assert not any(n.startswith(("tests/", "examples/", "bench/", "notebooks/")) for n in names)
    assert f"{PROJECT}-{version}.dist-info/licenses/LICENSE" in names
    assert re.search(rf"^Name: {DIST_NAME}$", meta, re.M)
    assert re.search(rf"^Version: {re.escape(version)}$", meta, re.M)
    assert re.search(r"^License-Expression: Apache-2.0$", meta, re.M)


SMOKE = r"""
import importlib.metadata, json, sys
from pathlib import Path

import numpy as np
import optim

scope = {}
exec(sys.argv[1], scope)
m, p = scope["m"], scope["p"]
np.testing.assert_allclose(p["enc"], [0.70, 1.70, 2.70], atol=5e-3)
np.testing.assert_allclose(m["dec"], [1.2997, 2.2996, 3.2994], atol=1e-4)
print(json.dumps({
    "file": optim.__file__,
    "version": optim.__version__,
    "dist_version": importlib.metadata.version("optim-jax"),
    "py_typed": (Path(optim.__file__).parent / "py.typed").is_file(),
    "tied": m["enc"] is m["dec"],
    "fused": optim._engine.fused.AVAILABLE,
}))
"""


def test_wheel_installs_in_a_fresh_environment_and_runs_the_readme_tie_example(dist, tmp_path):
    wheel = _one(dist, f"{PROJECT}-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    # Installed before the .pth below exists, so pip sees an empty environment (not this one's optim-jax).
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)])
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip())
    ours = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))
    (site / "_test_environment_packages.pth").write_text("".join(f"{p}\n" for p in ours))

    work = tmp_path / "work"
    work.mkdir()
    out = _run([str(python), "-I", "-c", SMOKE, _tie_block()], cwd=work)
    got = json.loads(out.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(venv), f"optim imported from {got['file']}, not the new environment"
    assert got["version"] == got["dist_version"] == _source_version()
    assert got["py_typed"]
    assert got["tied"]
    assert got["fused"]                 # the wheel's kernel loads (and ran the example's Adam step)


def test_notebook_install_cell_installs_optim_jax_or_says_how(dist, tmp_path):
    """The first code cell of every notebook, run as is in a fresh environment without optim: with nothing to
    install from it prints how to install from a clone; with the wheel on the (offline) index it installs
    optim-jax; with optim importable it does nothing."""
    nbformat = pytest.importorskip("nbformat")
    paths = sorted((ROOT / "notebooks").glob("*.ipynb"))
    cells = {p.name: nbformat.read(p, as_version=4).cells[1].source for p in paths}
    assert len(set(cells.values())) == 1, f"the notebooks' install cells differ: {sorted(cells)}"
    cell = next(iter(cells.values()))
    assert "optim-jax" in cell and "<owner>" not in cell

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])   # with pip: the cell runs `python -m pip`
    python = venv / "bin" / "python"
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    # No network: no index, no configuration files, packages only from the folder in PIP_FIND_LINKS; no
    # dependencies (jax is not needed to find optim).
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_NO_DEPS="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    def run_cell(links):
        return _run([str(python), "-I", "-c", cell], cwd=tmp_path, env={**env, "PIP_FIND_LINKS": str(links)})

    found = [str(python), "-I", "-c", "import importlib.util; print(importlib.util.find_spec('optim') is not None)"]
    out = run_cell(empty)
    assert "pip install optim-jax` did not install it" in out and "git clone" in out
    assert _run(found, cwd=tmp_path).strip() == "False"
    assert run_cell(dist) == ""
    assert _run(found, cwd=tmp_path).strip() == "True"
    assert run_cell(empty) == ""
