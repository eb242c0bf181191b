"""Helpers shared by the test files: `from conftest import close, arr, counted_update`.

pytest imports the test files with `tests/` on `sys.path` (its default "prepend" import mode; there is no
`tests/__init__.py`), so this conftest is an ordinary importable module too, like `test_rules` is for
`test_stacking`.
"""

import os

# Before JAX starts: XLA:CPU's thread pool is as large as the machine (2 threads on CI). jaxlib 0.10's batched
# LAPACK kernels (eigh, qr: SOAP) queue work on that pool and wait for it, so two at once on a 2-thread pool can
# wait for ever; SOAP runs its own one after another (optim/_rules/soap.py), and this makes the suite safe from
# any other overlap (tests/parallel_cases.py does the same for collectives).
os.environ.setdefault("PJRT_NPROC", str(max(32, os.cpu_count() or 1)))

import gc  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np
import pytest  # noqa: E402


def close(a, b, rtol=1e-6, atol=1e-6, err_msg=""):
    """`np.testing.assert_allclose` on any array-likes (jax or numpy arrays, lists, scalars), compared in
    float64, or complex128 when either side is complex, so float16 / bfloat16 / complex results compare alike.

    The default (rtol 1e-6, atol 1e-6) suits float32 results checked against exact numbers; a test that needs
    another tolerance passes it, and `rtol=0, atol=0` asks for equal values."""
    a, b = np.asarray(a), np.asarray(b)
    dtype = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
    np.testing.assert_allclose(a.astype(dtype), b.astype(dtype), rtol=rtol, atol=atol, err_msg=err_msg)


def arr(*values, dtype=jnp.float32):
    """A 1-D jax array of the given numbers: `arr(1, 2)` is float32 [1, 2]."""
    return jnp.array(values, dtype=dtype)


def counted_update():
    """`(step, traces)`: `optim.update` under `jax.jit`, and a list that grows by one each time it traces, so a
    test can count recompilations (`len(traces)`)."""
    import optim

    traces: list = []

    @jax.jit
    def step(state, model, grads):
        traces.append(1)
        return optim.update(state, model, grads)

    return step, traces


# ------------------------------------------------------------------------------------------ compiled programs
# Every program XLA:CPU compiles maps its code and data into the process (three mappings per piece), and JAX's
# caches keep them for the rest of the session: test_stacking.py alone leaves 15k mappings. Linux caps a process
# at vm.max_map_count (65530 by default), and the whole suite in one process passed it (then XLA's next compile
# aborted or crashed, at the same test in two CI runs). So JAX's caches are cleared after each test module, and
# after any test that leaves more than 40k mappings.
def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:       # not Linux
        return 0


def _release_compiled_programs() -> None:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_of_the_module():
    yield
    _release_compiled_programs()


@pytest.fixture(autouse=True)
def _compiled_programs_of_the_test():
    yield
    if _mappings() > 40_000:
        _release_compiled_programs()


# ------------------------------------------------------------------------------------------- background runs
# The multi-device cases (`parallel_cases.py`, `zero1_cases.py`, `split_cases.py`) run in subprocesses with their
# own device count.
# When their test files are collected, they start as soon as collection ends, so that on a machine with two
# cores they run beside the rest of the suite instead of after it (about a minute of `make test`). A test module
# gets its record with `background_cases(script, tmp)`: it waits for the run started here, or runs the script
# itself when none was started (a single test selected with -k, another runner).
import json as _json  # noqa: E402
import os as _os  # noqa: E402
import pathlib as _pathlib  # noqa: E402
import subprocess as _subprocess  # noqa: E402
import sys as _sys  # noqa: E402
import tempfile as _tempfile  # noqa: E402

_HERE = _pathlib.Path(__file__).resolve().parent
_BACKGROUND: dict = {}
_SCRIPTS = {"test_parallel.py": "parallel_cases.py", "test_zero1.py": "zero1_cases.py",
            "test_split_matrices.py": "split_cases.py"}


def _start(script: str, out: _pathlib.Path) -> _subprocess.Popen:
    env = {k: v for k, v in _os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return _subprocess.Popen([_sys.executable, str(_HERE / script), str(out)], env=env, stdout=_subprocess.PIPE,
                             stderr=_subprocess.PIPE, text=True)


def _start_command(argv: list, env: dict, out: _pathlib.Path) -> _subprocess.Popen:
    """`python *argv` from the repository root, `{out}` in `argv` replaced by the folder `out`."""
    return _subprocess.Popen([_sys.executable, *[a.replace("{out}", str(out)) for a in argv]], cwd=_HERE.parent,
                             env=dict(_os.environ, **env), stdout=_subprocess.PIPE, stderr=_subprocess.PIPE,
                             text=True)


def pytest_collection_finish(session):
    wanted = {_SCRIPTS[item.path.name] for item in session.items if item.path.name in _SCRIPTS}
    for script in sorted(wanted):
        out = _pathlib.Path(_tempfile.mkdtemp(prefix="optim-bg-")) / "cases.json"
        _BACKGROUND[script] = (_start(script, out), out)
    # Commands a test module declares in `BACKGROUND_RUNS` (test name -> (argv, env)): subprocesses that only
    # wait on their own work (the benchmarks' smoke runs), started now for the selected tests, beside the rest.
    for item in session.items:
        runs = getattr(getattr(item, "module", None), "BACKGROUND_RUNS", {})
        if item.name in runs and item.name not in _BACKGROUND:
            out = _pathlib.Path(_tempfile.mkdtemp(prefix="optim-bg-"))
            _BACKGROUND[item.name] = (_start_command(*runs[item.name], out), out)


def pytest_sessionfinish(session, exitstatus):
    for proc, _ in _BACKGROUND.values():     # a run nobody waited for (its tests deselected or failed early)
        if proc.poll() is None:
            proc.kill()


def background_run(request, tmp: _pathlib.Path, timeout: float = 1800) -> tuple:
    """`(returncode, stdout, stderr, folder)` of the command the test's module declares for it in
    `BACKGROUND_RUNS`: from the run started after collection, else from a run started now in `tmp`. `timeout`
    is a hang guard only, generous: a loaded machine runs these several times slower."""
    name = request.node.name
    proc, out = _BACKGROUND.pop(name, (None, None))
    if proc is None:
        out = tmp
        proc = _start_command(*request.module.BACKGROUND_RUNS[name], out)
    stdout, stderr = _wait(proc, timeout, f"{name}'s command")
    return proc.returncode, stdout, stderr, out


def _wait(proc: _subprocess.Popen, timeout: float, what: str) -> tuple[str, str]:
    """`proc`'s stdout and stderr once it ends; killed, and the test failed, after `timeout` seconds."""
    try:
        return proc.communicate(timeout=timeout)
    except _subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{what} did not finish in {timeout} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")


def case_record(cases: dict, name: str) -> dict:
    """The record of case `name`, checked: it ran, trained the tied model 6 steps and matched one device."""
    rec = cases[name]
    assert rec["ok"], f"{name}: {rec.get('error')}\n{rec.get('traceback', '')}"
    assert rec["tied"] and rec["step"] == 6
    assert rec["max_abs_diff"] < 1e-4
    return rec


def background_cases(script: str, tmp: _pathlib.Path, timeout: float = 1200) -> dict:
    """The records `script` wrote: from the run started after collection, else from a run started now."""
    proc, out = _BACKGROUND.pop(script, (None, None))
    if proc is None:
        out = tmp / "cases.json"
        proc = _start(script, out)
    stdout, stderr = _wait(proc, timeout, script)
    assert proc.returncode == 0, f"{script} failed:\n{stdout}\n{stderr[-6000:]}"
    return _json.loads(out.read_text())
