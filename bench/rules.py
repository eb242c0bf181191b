"""`python -m bench.rules [--quick] [--only ...] [--out bench/RULES.md]`: rules other than float32 Adam vs optax.

Sections (each measured on the workloads of the main bench, `bench/workloads.py`):

- `adafactor`: `optim.Adafactor(0.01)` vs `optax.adafactor(0.01)` (defaults otherwise) on `tied-lm`, and on its
  untied twin `untied-lm` (same unique parameters, no head) in the same process.
- `muon`: `optim.Muon(0.02)` on 2-D parameters and, on the others, the rule that equals optax's AdamW branch,
  vs `optax.contrib.muon(0.02)`, on `tied-lm` and `untied-lm`.
- `bf16-tied-lm`, `bf16-1000x16k`: `optim.Adam(1e-3)` with float32 moments, with `mu_dtype=bfloat16`, and with
  `mu_dtype=nu_dtype=bfloat16`, vs `optax.adam(1e-3)` and `optax.adam(1e-3, mu_dtype=bfloat16)`.

Method (as `python -m bench`): per section, ONE child process times every candidate interleaved round by round
(the order rotates each round; a sample is `reps` back-to-back steps and one block); ratios are medians of
per-round ratios, with their IQR. First call (trace + compile + one step) and peak RSS come from a separate
child process per candidate. Before timing, the step process runs 3 steps of every optim candidate and its
optax counterpart from the same untied parameters and compares the results (the largest difference between
the two parameter changes, relative to the largest change, over leaves); a failed check is recorded and makes
the command exit 1. `--quick` runs tiny sizes in a few processes (the numbers mean nothing; the test suite
runs it). Writes the markdown to `--out` (default `bench/RULES.md`) and the raw results next to it as .json;
`--only` re-measures some sections and merges them into the saved results.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from . import candidates as C
from . import runner, workloads
from .worker import MARK, timed_rounds

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

LR_ADAFACTOR = 0.01
LR_MUON = 0.02
LR_ADAM = C.LR                      # 1e-3, as the main bench
B2 = 0.999                          # optax.contrib.muon's adam_b2 (its default)

UNTIED = C.UNTIED                   # " @untied": the same candidate on the untied twin
TOL_F32 = 1e-4                      # elementwise float32 rules: measured ~5e-6
TOL_MUON = 1e-3                     # 5 Newton-Schulz iterations of float32 matmuls (K up to 16384): ~1e-5
TOL_BF16 = 2e-2                     # bfloat16 moments: one rounding flip of m is 2^-8 of it
CHECK_STEPS = 3

BF16 = ["f32", "bf16 m", "bf16 m+v"]
OPTAX_BF16 = ["f32", "bf16 m"]      # optax.adam has mu_dtype only
MODES = ["optim eager donate", "optim jit"]


def _bf16_section(workload: str, modes: list[str]) -> dict:
    cands = [f"{m} [{v}]" for m in modes for v in BF16] + [f"optax [{v}]" for v in OPTAX_BF16]
    checks = []
    for m in modes:
        checks += [(f"{m} [f32]", "optax [f32]", TOL_F32), (f"{m} [bf16 m]", "optax [bf16 m]", TOL_BF16),
                   (f"{m} [bf16 m+v]", "optax [bf16 m]", TOL_BF16)]
    return {"family": "adam", "workload": workload, "candidates": cands, "twins": [], "first": cands,
            "checks": checks, "rounds": 15, "target": 0.2,
            "title": f"bfloat16 moments: Adam on {workload}"}


SECTIONS: dict[str, dict] = {
    "adafactor": {"family": "adafactor", "workload": "tied-lm", "candidates": MODES + ["optax"],
                  "twins": MODES + ["optax"], "first": MODES + ["optax"],
                  "checks": [(m, "optax", TOL_F32) for m in MODES], "rounds": 15, "target": 0.2,
                  "title": "Adafactor vs optax.adafactor"},
    "muon": {"family": "muon", "workload": "tied-lm", "candidates": MODES + ["optax"],
             "twins": MODES + ["optax"], "first": MODES + ["optax"],
             "checks": [(m, "optax", TOL_MUON) for m in MODES], "rounds": 4, "target": 0.0,
             "title": "Muon vs optax.contrib.muon"},
    "bf16-tied-lm": _bf16_section("tied-lm", MODES),
    # optim jit only: each optim program over 1000 leaves takes ~20 s to compile here (twice: first-call process
    # and step process), and eager-donated vs jit is not what this section is about.
    "bf16-1000x16k": _bf16_section("1000x16k", ["optim jit"]),
}
QUICK = {"rounds": 3, "target": 0.005}


# ------------------------------------------------------------------------------------------------ candidates
def _split(name: str) -> tuple[str, str | None, bool]:
    """'optim jit [bf16 m] @untied' -> ('optim jit', 'bf16 m', True)."""
    untied = name.endswith(UNTIED)
    if untied:
        name = name[: -len(UNTIED)]
    variant = None
    if name.endswith("]"):
        name, variant = name[:-1].split(" [")
    return name, variant, untied


def rules(family: str, variant: str | None):
    """(optim rule spec, optax transformation) of a section's family and moment variant (tx None: no optax twin)."""
    import jax.numpy as jnp
    import optax
    import optax.contrib
    import optim

    if family == "adafactor":
        return optim.Adafactor(LR_ADAFACTOR), optax.adafactor(LR_ADAFACTOR)
    if family == "muon":
        # optax.contrib.muon sends non-2-D parameters to optax.adamw(lr, eps=1e-8, weight_decay=0,
        # nesterov=True): that is optim's NAdam with η and ε scaled by √β₂ (optim.NAdam keeps Dozat's β₂ inside
        # the root; see its docstring). optim.AdamW would be the non-Nesterov step: a different computation.
        s = math.sqrt(B2)

        def rule(path, x):
            return optim.Muon(LR_MUON) if x.ndim == 2 else optim.NAdam(LR_MUON * s, eps=1e-8 * s)

        return rule, optax.contrib.muon(LR_MUON)
    if family == "adam":
        bf = jnp.bfloat16
        kw = {"f32": {}, "bf16 m": {"mu_dtype": bf}, "bf16 m+v": {"mu_dtype": bf, "nu_dtype": bf}}[variant]
        tx = {"f32": lambda: optax.adam(LR_ADAM), "bf16 m": lambda: optax.adam(LR_ADAM, mu_dtype=bf)}.get(variant)
        return optim.Adam(LR_ADAM, **kw), tx() if tx else None
    raise ValueError(family)


def buffer_bytes(tree) -> int:
    """Bytes of the distinct device buffers in `tree` (each buffer once; optax's (1,)-shaped placeholders count)."""
    import jax

    seen, total = set(), 0
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "nbytes"):
            continue
        key = x.unsafe_buffer_pointer() if isinstance(x, jax.Array) and x.size else ("id", id(x))
        if key not in seen:
            seen.add(key)
            total += int(x.nbytes)
    return total


class OptimCand(C.Candidate):
    """`optim.update` eagerly with `donate=True`, or inside the user's donating jit (as `bench.candidates`)."""

    def __init__(self, name, wl, rule, mode):
        import jax
        import optim

        self.name, self._grads, self._optim = name, wl.grads, optim
        self.model = C._copy_tree(wl.model)
        state = optim.setup(rule, self.model)
        self._jit = mode == "optim jit"
        if self._jit:
            self.state, self.model = C.unalias((state, self.model))
            self._fn = jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1))
        else:
            self.state = C.unalias(state)

    def step(self):
        if self._jit:
            self.state, self.model = self._fn(self.state, self.model, self._grads)
        else:
            self.state, self.model = self._optim.update(self.state, self.model, self._grads, donate=True)

    def block(self):
        import jax
        jax.block_until_ready((self.state, self.model))

    def params(self):
        return self.model

    def state_bytes(self):
        return buffer_bytes(self.state.stacks)


class OptaxCand(C.Candidate):
    """An optax transformation's step under `jax.jit`, donating (params, opt_state) (as `bench.candidates`)."""

    def __init__(self, name, wl, tx):
        import jax
        import optax

        self.name, self._grads = name, wl.grads
        self.params_ = C.unalias(C._copy_tree(wl.model))     # tied positions: two parameters for optax
        self.opt_state = tx.init(self.params_)

        def step(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._fn = jax.jit(step, donate_argnums=(0, 1))

    def step(self):
        self.params_, self.opt_state = self._fn(self.params_, self.opt_state, self._grads)

    def block(self):
        import jax
        jax.block_until_ready((self.params_, self.opt_state))

    def params(self):
        return self.params_

    def state_bytes(self):
        return buffer_bytes(self.opt_state)


def make(section: dict, name: str, wl):
    impl, variant, _ = _split(name)
    rule, tx = rules(section["family"], variant)
    if impl == "optax":
        return OptaxCand(name, wl, tx)
    if impl in MODES:
        return OptimCand(name, wl, rule, impl)
    raise ValueError(f"unknown candidate {name!r}")


def _workload(section: dict, quick: bool, untied: bool = False):
    wl = workloads.build_cached(section["workload"], quick=quick)
    if untied and wl.spec.get("twin"):
        wl = workloads.build_cached(wl.spec["twin"], quick=quick)
    return wl


def _check_workload(section: dict, quick: bool):
    """The untied model the numerical checks run on: the timed workload's untied twin (or itself); in quick
    mode an LM just big enough that Adafactor factors (axes >= 128) and Muon sees 2-D parameters of 3 shapes."""
    if quick and section["family"] == "adafactor":
        return _small_lm()
    return _workload(section, quick, untied=True)


def _small_lm(vocab: int = 256, d: int = 128, layers: int = 1):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(1)
    shapes = workloads._lm_shapes(vocab, d, layers)
    xs = {p: rng.standard_normal(s, dtype=np.float32) * np.float32(0.02) for p, s in shapes}
    gs = {p: rng.standard_normal(s, dtype=np.float32) * np.float32(1e-3) for p, s in shapes}
    n = sum(int(np.prod(s)) for _, s in shapes)
    return workloads.Workload("check-lm", {"kind": "lm"}, workloads._nest({p: jnp.asarray(v) for p, v in xs.items()}),
                              workloads._nest({p: jnp.asarray(v) for p, v in gs.items()}),
                              [(xs[p], gs[p]) for p, _ in shapes], len(shapes), n,
                              f"untied LM, vocab {vocab}, d {d}, {layers} layer(s), {n / 1e6:.2f}M parameters", True)


# ------------------------------------------------------------------------------------------------ child: steps
def _rel_diffs(a_tree, b_tree, x0_tree) -> tuple[float, float, str]:
    """(max over leaves of max|Δa - Δb| / max|Δb|, of max|a - b| / max|b|, the worst leaf's path), Δ = p - p0."""
    import jax
    import numpy as np

    worst_u, worst_p, where = 0.0, 0.0, ""
    a_leaves = jax.tree_util.tree_leaves_with_path(a_tree)
    b_leaves, x_leaves = jax.tree.leaves(b_tree), jax.tree.leaves(x0_tree)
    assert len(a_leaves) == len(b_leaves) == len(x_leaves)
    for (path, a), b, x0 in zip(a_leaves, b_leaves, x_leaves):
        a, b, x0 = (np.asarray(v, np.float64) for v in (a, b, x0))
        du, db = a - x0, b - x0
        ru = float(np.abs(du - db).max() / max(np.abs(db).max(), 1e-30))
        rp = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
        if ru > worst_u:
            worst_u, where = ru, jax.tree_util.keystr(path)
        worst_p = max(worst_p, rp)
    return worst_u, worst_p, where


def _interleave(cands: dict, rounds: int, target: float) -> dict:
    """As `bench.worker.interleave`, with a lighter warm-up so that seconds-long steps (Muon) fit: one step (none
    for a candidate the checks already stepped), then a calibration of >= 1 step (none when `target` <= 0:
    reps = 1)."""
    out, reps = {}, {}
    collect = target >= 0.05
    for name, c in list(cands.items()):
        try:
            if not getattr(c, "stepped", False):     # compile (the checked candidates already ran 3 steps)
                c.step()
                c.block()
            reps[name] = 1
            if target > 0:
                n, t0 = 0, time.perf_counter()
                while n < 1 or time.perf_counter() - t0 < target / 4:
                    c.step()
                    n += 1
                c.block()
                est = max((time.perf_counter() - t0) / n, 1e-7)
                reps[name] = int(min(100000, max(1, round(target / est))))
            out[name] = []
        except Exception as e:
            out[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            del cands[name]
    return timed_rounds(cands, reps, rounds, out, collect)


def child_steps(section: dict, quick: bool, rounds: int, target: float) -> dict:
    load0 = os.getloadavg()[0]
    wl = _workload(section, quick)
    names = list(section["candidates"]) + [n + UNTIED for n in section["twins"]]
    check_wl = _check_workload(section, quick)
    # Checks first: every checked candidate on the untied model, 3 steps from the same parameters. When that
    # model is the one a timed candidate runs on, the timed candidate itself is checked (and keeps its state).
    reuse = check_wl is wl or (check_wl is _workload(section, quick, untied=True) and section["twins"])
    checked: dict = {}
    t0 = time.perf_counter()
    for a, b, _ in section["checks"]:
        for n in (a, b):
            if n not in checked:
                checked[n] = make(section, n + ("" if check_wl is wl else UNTIED), check_wl)
    for c in checked.values():
        for _ in range(CHECK_STEPS):
            c.step()
        c.block()
        c.stepped = True
    checks = []
    for a, b, tol in section["checks"]:
        du, dp, where = _rel_diffs(checked[a].params(), checked[b].params(), check_wl.model)
        checks.append({"a": a, "b": b, "workload": check_wl.name, "steps": CHECK_STEPS, "tol": tol,
                       "max_rel_update_diff": du, "max_rel_param_diff": dp, "worst_leaf": where,
                       "passed": bool(du <= tol)})
    check_s = time.perf_counter() - t0
    cands = {}
    for n in names:
        key = n[: -len(UNTIED)] if n.endswith(UNTIED) else n
        if reuse and (n.endswith(UNTIED) or check_wl is wl) and key in checked:
            cands[n] = checked.pop(key)
            cands[n].name = n
        else:
            cands[n] = make(section, n, _workload(section, quick, untied=n.endswith(UNTIED)))
    del checked
    gc.collect()
    res = _interleave(cands, rounds, target)
    res["state_bytes"] = {n: c.state_bytes() for n, c in cands.items()}
    res.update(checks=checks, check_s=check_s, n_unique=wl.n_unique, unique_bytes=wl.unique_bytes,
               description=wl.description, loadavg=[load0, os.getloadavg()[0]])
    if section["twins"]:
        res["twin_description"] = _workload(section, quick, untied=True).description
    return res


def child_first(section: dict, quick: bool, names: list[str]) -> dict:
    """Per candidate: first step (trace + compile + run), second step, RSS before the first step, peak RSS (as
    `bench.worker`), and RSS after the second step."""
    out = {}
    for name in names:
        wl = _workload(section, quick)
        cand = make(section, name, wl)
        gc.collect()
        rss0 = _rss_mb()
        t0 = time.perf_counter()
        cand.step()
        cand.block()
        t1 = time.perf_counter()
        cand.step()
        cand.block()
        t2 = time.perf_counter()
        gc.collect()
        out[name] = {"first_s": t1 - t0, "second_s": t2 - t1, "rss_before_mb": rss0, "peak_rss_mb": _rss_mb(),
                     "rss_after_mb": _current_rss_mb(), "state_bytes": cand.state_bytes()}
        del cand
    return out


def _rss_mb() -> float:
    """The process's peak RSS so far (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mb() -> float:
    """The process's RSS now (MB): after the second step, what the step keeps resident (no compiler peak)."""
    return runner._rss_mb(os.getpid())


# ------------------------------------------------------------------------------------------------ parent
def _child(args: list[str], timeout: float, log) -> dict:
    cmd = [sys.executable, "-m", "bench.rules", "--child", *args]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"    timeout > {timeout:.0f} s")
        return {"error": f"timeout > {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
            res["wall_s"] = time.perf_counter() - t0
            return res
    msg = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
    log(f"    failed (rc {p.returncode}): {msg}")
    return {"error": f"rc {p.returncode}: {msg}"}


def _ratios(s: list, ref) -> tuple:
    if not isinstance(ref, list) or not ref:
        return None, None
    r = [a / b for a, b in zip(s, ref)]
    return runner._median(r), runner._quartiles(r)


def reduce_section(name: str, sec: dict) -> dict:
    """Rows: step time, per-round ratios (to optax on the same workload; tied / untied twin; for bfloat16, to the
    optax and the same-mode float32 candidates), state bytes / unique parameter bytes, first call, peak RSS."""
    spec = SECTIONS[name]
    raw, first = sec.get("raw", {}), sec.get("first", {})
    samples = raw.get("samples", {})
    rows = {}
    for n, s in samples.items():
        if not isinstance(s, list):
            rows[n] = {"error": s}
            continue
        impl, variant, untied = _split(n)
        row = {"step_s": runner._median(s), "rounds": len(s)}
        suffix = UNTIED if untied else ""
        if spec["family"] == "adam":
            refs = {"optax_bf16": "optax [bf16 m]" + suffix, "optax_f32": "optax [f32]" + suffix,
                    "f32": ("optax" if impl == "optax" else impl) + " [f32]" + suffix}
        else:
            refs = {"optax": "optax" + suffix}
            if not untied and spec["twins"] and impl in spec["twins"]:
                refs["twin"] = n + UNTIED
        for key, ref in refs.items():
            row[f"vs_{key}"], row[f"vs_{key}_iqr"] = _ratios(s, samples.get(ref))
        sb = raw.get("state_bytes", {}).get(n)
        row["state_ratio"] = None if sb is None else sb / raw["unique_bytes"]
        row["state_bytes"] = sb
        f = first.get(n)
        if f and "first_s" in f:
            row.update(first_s=f["first_s"], second_s=f["second_s"], peak_rss_mb=f["peak_rss_mb"],
                       rss_before_mb=f["rss_before_mb"], rss_after_mb=f["rss_after_mb"])
            ref = first.get("optax [bf16 m]" if spec["family"] == "adam" else "optax", {})
            if "first_s" in ref:
                row["first_vs_optax"] = f["first_s"] / ref["first_s"]
            if spec["family"] == "adam":
                f32 = first.get(("optax" if impl == "optax" else impl) + " [f32]", {})
                if "peak_rss_mb" in f32:
                    row["rss_vs_f32"] = f["peak_rss_mb"] / f32["peak_rss_mb"]
                    row["rss_after_vs_f32"] = f["rss_after_mb"] / f32["rss_after_mb"]
        rows[n] = row
    return rows


def run_section(name: str, opts, log) -> dict:
    spec = SECTIONS[name]
    rounds = opts.rounds or (QUICK["rounds"] if opts.quick else spec["rounds"])
    target = opts.target if opts.target is not None else (QUICK["target"] if opts.quick else spec["target"])
    q = ["--quick"] if opts.quick else []
    sec: dict = {"section": name, "title": spec["title"], "workload": spec["workload"], "date": runner._now(),
                 "optim": runner.optim_version(), "first": {}, "rounds": rounds, "target": target,
                 "expected_rows": list(spec["candidates"]) + [n + UNTIED for n in spec["twins"]],
                 "first_candidates": list(spec["first"])}
    if opts.quick:      # one first-call process for the whole section (RSS is then a running maximum)
        log(f"  {name}: first calls ({len(spec['first'])} candidates, one process)")
        r = _child(["first", "--section", name, "--candidates", ",".join(spec["first"]), *q], opts.timeout, log)
        sec["first"] = r if "error" in r else r["first"]
    else:
        for c in spec["first"]:
            log(f"  {name}: first call: {c}")
            r = _child(["first", "--section", name, "--candidates", c, *q], opts.timeout, log)
            sec["first"][c] = r["first"][c] if "first" in r else r
    log(f"  {name}: checks and step timing ({rounds} rounds, target {target} s)")
    raw = _child(["steps", "--section", name, "--rounds", str(rounds), "--target", str(target), *q],
                 opts.timeout * 4, log)
    sec["raw"] = raw
    end = runner.optim_version()
    if end != sec["optim"]:
        sec["optim"] += f" -> {end} (optim changed during the run)"
    if "samples" in raw:
        sec["rows"] = reduce_section(name, sec)
        for c in raw["checks"]:
            log(f"    check {c['a']} vs {c['b']}: {c['max_rel_update_diff']:.1e} (tol {c['tol']:g}) "
                f"{'ok' if c['passed'] else 'FAILED'}")
        log(f"    child wall time {raw['wall_s']:.0f} s (checks {raw['check_s']:.0f} s)")
    return sec


# ------------------------------------------------------------------------------------------------ markdown
def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f}" if s >= 1e-3 else f"{1e3 * s:.3f}"


def _r(row, key):
    v = row.get(f"vs_{key}")
    if v is None:
        return "–"
    iqr = row.get(f"vs_{key}_iqr") or (None, None)
    return f"{v:.2f} ({iqr[0]:.2f}–{iqr[1]:.2f})" if iqr[0] is not None else f"{v:.2f}"


def _when(sec: dict) -> str:
    raw = sec.get("raw", {})
    s = f"measured {sec['date']} (optim {sec.get('optim', '?')}), {sec.get('rounds')} rounds"
    if raw.get("loadavg"):
        s += f", load average {raw['loadavg'][0]:.1f} -> {raw['loadavg'][1]:.1f}"
    if raw.get("wall_s"):
        s += f", step process {raw['wall_s']:.0f} s"
    return s


def _checks_md(sec: dict) -> list[str]:
    checks = sec.get("raw", {}).get("checks", [])
    if not checks:
        return []
    wl = checks[0]["workload"]
    out = [f"Numerical check ({checks[0]['steps']} steps from the same parameters on `{wl}`; largest "
           "|Δoptim − Δoptax| / max |Δoptax| over leaves, Δ = parameter change; also max |optim − optax| / max "
           "|optax| of the parameters): " +
           "; ".join(f"`{c['a']}` vs `{c['b']}` {c['max_rel_update_diff']:.1e} / {c['max_rel_param_diff']:.1e} "
                     f"(tol {c['tol']:g}, {'ok' if c['passed'] else '**FAILED**'})" for c in checks) + ".", ""]
    return out


def section_md(name: str, sec: dict) -> list[str]:
    spec = SECTIONS[name]
    rows = sec.get("rows")
    out = [f"### {sec['title']} (`{name}`)", ""]
    raw = sec.get("raw", {})
    desc = raw.get("description", "")
    if raw.get("twin_description"):
        desc += f"; rows marked `{UNTIED.strip()}`: the untied twin, {raw['twin_description']}"
    out += [f"{sec['workload']}: {desc}; {_when(sec)}.", ""]
    if not rows:
        return out + [f"No results: {raw.get('error', 'see the JSON')}", ""]
    order = [n for n in sec.get("expected_rows", []) if n in rows]     # the JSON is saved with sorted keys
    rows = {n: rows[n] for n in order + [n for n in rows if n not in order]}
    if spec["family"] == "adam":
        out += ["| candidate | moments | step (ms) | vs optax m bf16 | vs optax f32 | vs same-mode f32 "
                "| first call (s) | peak RSS (MB) | peak vs f32 | RSS after step (MB) | after vs f32 | state |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        def line(n, r):
            impl, variant, _ = _split(n)
            return (f"| {impl} | {variant} | {_ms(r['step_s'])} | {_r(r, 'optax_bf16')} | {_r(r, 'optax_f32')} "
                    f"| {_r(r, 'f32')} | {_f(r.get('first_s'))} | {_f(r.get('peak_rss_mb'), '{:.0f}')} "
                    f"| {_f(r.get('rss_vs_f32'))} | {_f(r.get('rss_after_mb'), '{:.0f}')} "
                    f"| {_f(r.get('rss_after_vs_f32'))} "
                    f"| {_f(r.get('state_ratio'), '{:.3f}x')} |")
    else:
        out += ["| candidate | step (ms) | vs optax (same model) | tied / untied | first call (s) "
                "| first call vs optax | peak RSS (MB) | state |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        def line(n, r):
            return (f"| {n} | {_ms(r['step_s'])} | {_r(r, 'optax')} | {_r(r, 'twin')} "
                    f"| {_f(r.get('first_s'))} | {_f(r.get('first_vs_optax'))} "
                    f"| {_f(r.get('peak_rss_mb'), '{:.0f}')} | {_f(r.get('state_ratio'), '{:.4f}x')} |")
    out += [f"| {n} | {r['error']} |" if "error" in r else line(n, r) for n, r in rows.items()]
    return out + [""] + _checks_md(sec)


INTRO = """\
Method: as `bench/RESULTS.md`. Per section one process times all candidates interleaved round by round (the
order rotates each round; a sample is `reps` back-to-back steps and one block, `reps` chosen so a sample takes
about the section's target, at least one step); *vs X* is the median over rounds of the per-round ratio to
candidate X (IQR in brackets; lower is faster). *First call* (trace + compile + one step) and *peak RSS*
(high-water mark, including the workload's own arrays and the compiler's peak; *RSS after step*: the resident
set after the second step, what stays) come from a separate process per candidate. *State* is the optimiser
state's bytes (each distinct buffer once, optax's `(1,)`-shaped placeholders and step counts included) divided
by the unique parameter bytes. Candidates: `optim eager donate` = `optim.update(state, model, grads,
donate=True)`; `optim jit` = `optim.update` inside the user's `jax.jit(..., donate_argnums=(0, 1))`; `optax` =
the transformation's step under `jax.jit` donating (params, opt_state). Rows marked `@untied` run on the untied
twin (same unique parameters, no head) in the same process; *tied / untied* is the per-round ratio of a
candidate to its own twin. On the tied model optax sees `emb` and `head.w` as two parameters: it keeps state for
both, and for Muon it runs Newton-Schulz twice (once per position) where optim runs it once on the summed
gradient.

Rules: Adafactor: `optim.Adafactor(0.01)` vs `optax.adafactor(0.01)`, other arguments default. Muon:
`optim.setup(lambda path, x: optim.Muon(0.02) if x.ndim == 2 else optim.NAdam(0.02 * √0.999, eps=1e-8 * √0.999),
model)` vs `optax.contrib.muon(0.02)`: the same partition (2-D parameters to Muon); optax's other branch is
`optax.adamw(0.02, eps=1e-8, weight_decay=0, nesterov=True)`, which is optim's NAdam with η and ε scaled by √β₂
(plain `optim.AdamW` would be the non-Nesterov step). bfloat16 moments: `optim.Adam(1e-3)`, `Adam(1e-3,
mu_dtype=bf16)`, `Adam(1e-3, mu_dtype=bf16, nu_dtype=bf16)` vs `optax.adam(1e-3)` and `optax.adam(1e-3,
mu_dtype=bf16)` (optax has no `nu_dtype`); *vs same-mode f32* compares with the float32 candidate of the same
kind (`optim jit [f32]` for `optim jit [bf16 m]`, etc.)."""


def render(data: dict) -> str:
    m = data.get("machine", {})
    out = ["## Other rules: Adafactor, Muon, bfloat16 moments (`python -m bench.rules`)", "",
           f"Generated by `{data.get('command', 'python -m bench.rules')}`, {data.get('date', '?')}"
           f" (total {data.get('total_s', 0):.0f} s). Machine: " + ", ".join(f"{k} {v}" for k, v in sorted(m.items())),
           "", INTRO, ""]
    for name in SECTIONS:
        if name in data.get("sections", {}):
            out += section_md(name, data["sections"][name])
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------------------------------------ main
def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.rules", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 3 rounds, few processes (~1 minute)")
    ap.add_argument("--only", default=None, help=f"comma-separated sections: {', '.join(SECTIONS)} (default all)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default per section; quick 3)")
    ap.add_argument("--target", type=float, default=None, help="seconds per timed sample (default per section)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per first-call process (default 300; "
                                                                "quick 120); the step process gets 4x")
    ap.add_argument("--out", default=None, help="markdown output (default bench/RULES.md; quick: stdout unless "
                                                "given); the raw results go next to it as .json")
    ap.add_argument("--fresh", action="store_true", help="discard previously saved sections instead of merging")
    ap.add_argument("--child", default=None, choices=["first", "steps"], help=argparse.SUPPRESS)
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--candidates", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.timeout = a.timeout or (120.0 if a.quick else 300.0)
    if a.out is None and not a.quick and a.child is None:
        a.out = str(HERE / "RULES.md")
    return a


def main(argv=None) -> int:
    opts = parse(argv)
    if opts.child:
        section = SECTIONS[opts.section]
        if opts.child == "first":
            res = {"first": child_first(section, opts.quick, opts.candidates.split(","))}
        else:
            res = child_steps(section, opts.quick, opts.rounds, opts.target)
        sys.stdout.write(MARK + json.dumps(res) + "\n")
        sys.stdout.flush()
        return 0

    t_start = time.perf_counter()
    log = (lambda msg: print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True))
    chosen = list(SECTIONS) if opts.only is None else [s.strip() for s in opts.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    # No persistent compilation cache shared with the step process: writing one adds ~150 MB to a first-call
    # process's peak RSS on 1000x16k (serialised programs), which would blur the bfloat16 RSS comparison.
    sections = {}
    for name in chosen:
        log(name)
        sections[name] = run_section(name, opts, log)
    out = Path(opts.out) if opts.out else None
    data: dict = {"sections": {}}
    if out is not None and not opts.fresh and opts.only is not None:
        data = runner.load(out.with_suffix(".json")) or data
    data["sections"].update(sections)
    data["machine"] = runner.machine_info()
    data["date"] = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    data["command"] = " ".join(["python -m bench.rules", *(argv if argv is not None else sys.argv[1:])])
    data["total_s"] = time.perf_counter() - t_start
    md = render(data)
    runner.write_report(out, md, data, log)
    bad = [s for s, sec in sections.items() if "rows" not in sec]
    failed = [f"{s}: {c['a']} vs {c['b']}" for s, sec in sections.items()
              for c in sec.get("raw", {}).get("checks", []) if not c["passed"]]
    if bad:
        log(f"sections without results: {bad}")
    if failed:
        log(f"numerical checks FAILED: {failed}")
    log(f"total {time.perf_counter() - t_start:.1f} s")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
