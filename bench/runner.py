"""Orchestration: run the worker processes with timeouts, reduce samples to medians and ratios, save results.

Results are kept per section in `RESULTS.json` next to `RESULTS.md`; a partial run (`--only`) replaces only
the sections it ran, so the 10000-leaf workload can be measured on its own and merged into the table.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import candidates as C
from .worker import MARK

REF = C.REFERENCE

ROOT = Path(__file__).resolve().parent.parent


def _mem_available_mb() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


def _rss_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _run_worker(args: list[str], timeout: float, log, reserve_mb: float = 1500,
                module: str = "bench.worker") -> dict:
    """Run `python -m MODULE ARGS` (default `bench.worker`; `bench.step` runs its own children through it too);
    returns its JSON line, or {'error': ...} / {'timeout': N} / {'oom': MB}.

    A watchdog kills the child when the machine's available memory falls below `reserve_mb` (the 10000-leaf
    compiles can take 20+ GB), so the suite reports it instead of the kernel's OOM killer choosing a victim.
    """
    cmd = [sys.executable, "-m", module, *args]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        peak, why = 0.0, None
        while p.poll() is None:
            peak = max(peak, _rss_mb(p.pid))
            if time.perf_counter() - t0 > timeout:
                why = {"timeout": timeout}
            elif _mem_available_mb() < reserve_mb:
                why = {"oom": peak}
            if why:
                p.kill()
                p.wait()
                break
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        if why:
            log(f"    timeout > {timeout:.0f} s" if "timeout" in why else
                f"    killed: machine out of memory (child RSS {peak / 1024:.1f} GB)")
            why["wall_s"] = wall
            return why
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
            res["wall_s"] = wall
            return res
    msg = (stderr.strip().splitlines() or ["no output"])[-1][:300]
    if p.returncode == -9:
        msg += " (SIGKILL: probably the kernel's OOM killer)"
    log(f"    failed (rc {p.returncode}): {msg}")
    return {"error": f"rc {p.returncode}: {msg}"}


def _median(xs):
    return statistics.median(xs) if xs else None


def _quartiles(xs):
    if len(xs) < 4:
        return (min(xs), max(xs)) if xs else (None, None)
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def reduce_steps(raw: dict) -> dict:
    """Per candidate: median step time, and median over rounds of the per-round ratios to optax and to the
    Adam floor derived from the probe (probe time x 28/12)."""
    samples = raw["samples"]
    ref = samples.get(C.REFERENCE)
    probe = samples.get("probe")
    ref = ref if isinstance(ref, list) and ref else None
    probe = probe if isinstance(probe, list) and probe else None
    rows = {}
    for name, s in samples.items():
        if not isinstance(s, list):
            rows[name] = {"error": s}
            continue
        row = {"step_s": _median(s), "rounds": len(s), "params_per_s": raw["n_unique"] / _median(s)}
        if ref:
            r = [a / b for a, b in zip(s, ref)]
            row["vs_optax"] = _median(r)
            row["vs_optax_iqr"] = _quartiles(r)
        if probe:
            r = [a / (b * C.ADAM_BYTES / C.PROBE_BYTES) for a, b in zip(s, probe)]
            row["vs_floor"] = _median(r)
        twin = samples.get(name + C.UNTIED)
        if isinstance(twin, list) and twin:
            row["vs_untied"] = _median([a / b for a, b in zip(s, twin)])
        rows[name] = row
    return rows


def _first_failure(r: dict, opts) -> str | None:
    """Why a candidate's first call rules it out of the step process (it would time out or exhaust memory)."""
    if "timeout" in r:
        return f"first call timeout > {opts.timeout:.0f} s"
    if "oom" in r:
        return f"first call out of memory (> {r['oom'] / 1024:.1f} GB RSS)"
    if "error" in r and "SIGKILL" in r["error"]:
        return "first call killed (out of memory?)"
    return None


def run_workloads(names: list[str], cands: list[str], opts, log) -> dict:
    """Per workload: first-call subprocesses (one per candidate), then the interleaved step process."""
    secs = {}
    for name in names:
        sec: dict = {"kind": "workload", "workload": name, "date": _now(), "first": {}, "optim": optim_version()}
        first_cands = cands if opts.first is None else [c for c in cands if c in opts.first]
        for c in first_cands:
            log(f"  {name}: first call: {c}")
            sec["first"][c] = _run_worker(["first", "--workload", name, "--candidate", c],
                                          opts.timeout, log)
        secs[name] = sec
    for group in [[n] for n in names]:
        # A candidate whose first call timed out would hang the step process too: leave it out there.
        skip = {c: _first_failure(r, opts) for n in group for c, r in secs[n]["first"].items()
                if _first_failure(r, opts)}
        step_cands = [c for c in cands if c not in skip]
        for n in group:
            for c, why in skip.items():
                secs[n].setdefault("skipped", {})[c] = f"left out: {why}"
        compile_s = sum(secs[n]["first"].get(c, {}).get("first_s", opts.timeout / 4)
                        for n in group for c in step_cands)
        budget = 60 + 2.5 * compile_s + len(group) * len(step_cands) * opts.rounds * opts.target * 3
        log(f"  {','.join(group)}: step timing of {', '.join(step_cands)} ({opts.rounds} rounds, "
            f"timeout {budget:.0f} s)")
        raw = _run_worker(["steps", "--workload", ",".join(group), "--candidates", ",".join(step_cands),
                           "--rounds", str(opts.rounds), "--target", str(opts.target)], budget, log)
        for n in group:
            r = raw["multi"][n] if "multi" in raw else raw
            secs[n]["raw"] = r
            secs[n]["date"] = _now()
            end = optim_version()
            if end != secs[n]["optim"]:
                secs[n]["optim"] += f" -> {end} (optim changed during the run)"
            if "samples" in r:
                secs[n]["rows"] = reduce_steps(r)
    return secs


OVERHEAD = ["optim eager", "optim eager donate", "optim jit", "optax", "optax eager"]
QUICK_OVERHEAD = OVERHEAD[:-1]   # optax eager compiles ~60 primitive programs: seconds, too slow for --quick


def run_quick(names: list[str], cands: list[str], opts, log) -> dict:
    """Everything in one worker process (plus the first-call subprocesses of one workload)."""
    secs = {}
    for name in names:
        secs[name] = {"kind": "workload", "workload": name, "date": _now(), "first": {}, "optim": optim_version()}
    if "1000x16k" in names:
        for c in ["optim eager", REF]:
            log(f"  1000x16k: first call: {c}")
            secs["1000x16k"]["first"][c] = _run_worker(
                ["first", "--workload", "1000x16k", "--candidate", c, "--quick"], opts.timeout, log)
    log(f"  one process: {', '.join(names)}, overhead, setup")
    raw = _run_worker(["quick", "--workload", ",".join(names), "--candidates", ",".join(cands),
                       "--overhead-candidates", ",".join(QUICK_OVERHEAD), "--rounds", str(opts.rounds),
                       "--target", str(opts.target), "--quick"], opts.timeout, log)
    for n in names:
        r = raw["multi"][n] if "multi" in raw else raw
        secs[n]["raw"] = r
        if "samples" in r:
            secs[n]["rows"] = reduce_steps(r)
    secs["overhead"] = _overhead_section(raw.get("overhead", raw))
    secs["setup"] = _setup_section(raw.get("setup", raw))
    return secs


def run_overhead(opts, log) -> dict:
    log(f"  per-call overhead: {', '.join(OVERHEAD)}")
    raw = _run_worker(["overhead", "--candidates", ",".join(OVERHEAD), "--rounds", str(opts.rounds),
                       "--target", str(opts.target / 2)], max(120.0, opts.timeout), log)
    return _overhead_section(raw)


def _overhead_section(raw: dict) -> dict:
    sec = {"kind": "overhead", "date": _now(), "raw": raw, "optim": optim_version()}
    if "samples" in raw:
        ref = raw["samples"].get("optax")
        rows = {}
        for n, s in raw["samples"].items():
            if not isinstance(s, list):
                rows[n] = {"error": s}
                continue
            rows[n] = {"call_s": _median(s)}
            if isinstance(ref, list):
                rows[n]["vs_optax"] = _median([a / b for a, b in zip(s, ref)])
        sec["rows"] = rows
    return sec


def run_setup(opts, log) -> dict:
    log("  setup time on the 10000-leaf model")
    raw = _run_worker(["setup", "--rounds", str(max(3, opts.rounds // 3))], max(120.0, opts.timeout), log)
    return _setup_section(raw)


def _setup_section(raw: dict) -> dict:
    sec = {"kind": "setup", "date": _now(), "raw": raw, "optim": optim_version()}
    if "samples" in raw:
        sec["rows"] = {n: {"setup_s": _median(s)} for n, s in raw["samples"].items()}
    return sec


def _now() -> str:
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def optim_version() -> str:
    """The optim commit measured (with '+dirty' when optim/ has uncommitted changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "optim"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (head or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info() -> dict:
    import platform

    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                info["memory_gb"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("jax", "jaxlib", "optax", "torch", "numpy"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = "not installed"
    for k in ("XLA_FLAGS", "OMP_NUM_THREADS", "BENCH_TORCH_THREADS"):
        if os.environ.get(k):
            info[k] = os.environ[k]
    return info


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def write_report(out: Path | None, md: str, data: dict, log=print) -> None:
    """A bench script's report: the markdown to `out` and the raw data next to it as `.json` (folders made as
    needed), or the markdown to stdout when `out` is None."""
    if out is None:
        print(md)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    save(out.with_suffix(".json"), data)
    out.write_text(md)
    log(f"wrote {out} and {out.with_suffix('.json')}")
