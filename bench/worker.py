"""Measurements that run in a child process (`python -m bench.worker MODE ...`), one JSON line on stdout.

- `first`: one candidate on one workload: time of the first step (trace + compile + run), of the second step,
  and the process's peak RSS (a high-water mark, hence one process per candidate).
- `steps`: all requested candidates on one workload in one process, interleaved round by round (the order
  rotates every round); each sample times `reps` back-to-back steps and one block.
- `overhead`: per-call cost on a tiny 10-leaf model, same interleaving.
- `setup`: `optim.setup` (and `optax.adam(...).init` for scale) on the 10000-leaf model.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time

MARK = "BENCH-JSON "


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux: KiB


def _emit(obj) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def first(args) -> dict:
    from . import candidates, workloads

    wl = workloads.build(args.workload, quick=args.quick)
    cand = candidates.make(args.candidate, wl)
    gc.collect()
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    cand.step()
    cand.block()
    t1 = time.perf_counter()
    cand.step()
    cand.block()
    t2 = time.perf_counter()
    return {"first_s": t1 - t0, "second_s": t2 - t1, "rss_before_mb": rss0, "peak_rss_mb": _rss_mb(),
            "state_bytes": cand.state_bytes()}


def interleave(cands: dict, rounds: int, target_s: float, max_reps: int = 100000) -> dict:
    """Warm up and calibrate each candidate, then time `rounds` rounds; returns per-candidate sample lists
    (seconds per step) or an error string."""
    out: dict = {}
    reps: dict = {}
    collect = target_s >= 0.05          # a full collection costs tens of ms with JAX loaded
    for name, c in list(cands.items()):
        try:
            c.step()                       # compile (already measured separately) and warm up
            c.block()
            c.step()
            c.block()
            n, t0 = 0, time.perf_counter()
            while n < 3 or time.perf_counter() - t0 < target_s / 4:
                c.step()
                n += 1
            c.block()
            est = max((time.perf_counter() - t0) / n, 1e-7)
            reps[name] = int(min(max_reps, max(1, round(target_s / est))))
            out[name] = []
        except Exception as e:             # a failing candidate is reported, the others still run
            out[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            del cands[name]
    return timed_rounds(cands, reps, rounds, out, collect)


def timed_rounds(cands: dict, reps: dict, rounds: int, out: dict, collect: bool) -> dict:
    """`rounds` rounds over the calibrated candidates, each starting at the next candidate (no candidate always
    runs first): `reps[name]` steps per sample, appended to `out[name]`; a full `gc` before each sample when
    `collect`, none during it."""
    names = list(cands)
    for r in range(rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            c, n = cands[name], reps[name]
            if collect:
                gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                for _ in range(n):
                    c.step()
                c.block()
                out[name].append((time.perf_counter() - t0) / n)
            finally:
                gc.enable()
    return {"samples": out, "reps": reps}


def steps(args) -> dict:
    """One workload, or several (comma-separated; `--quick` runs them all in one process to save startup)."""
    names = args.workload.split(",")
    if len(names) > 1:
        return {"multi": {w: _steps_one(w, args) for w in names}}
    return _steps_one(names[0], args)


def _steps_one(workload: str, args) -> dict:
    from . import candidates, workloads

    load0 = os.getloadavg()[0]
    wl = workloads.build_cached(workload, quick=args.quick)
    names = args.candidates.split(",")
    if wl.spec.get("twin"):      # tied workload: also time optim on the untied twin, in the same process
        names += [n + candidates.UNTIED for n in names if n.startswith("optim")]
    cands, errors, state_bytes = {}, {}, {}
    for name in names:
        try:
            cands[name] = candidates.make(name, wl)
        except Exception as e:
            errors[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    res = interleave(cands, args.rounds, args.target)
    for name, c in cands.items():
        try:
            state_bytes[name] = c.state_bytes()
        except Exception:
            state_bytes[name] = None
    res["samples"].update(errors)
    if "torch" in sys.modules:
        res["torch_threads"] = sys.modules["torch"].get_num_threads()
    res.update(state_bytes=state_bytes, n_unique=wl.n_unique, n_positions=wl.n_positions,
               unique_bytes=wl.unique_bytes, description=wl.description, loadavg=[load0, os.getloadavg()[0]])
    return res


def overhead(args) -> dict:
    from . import candidates, workloads

    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = [(16, 16), (16,)] * 5            # 5 weight/bias pairs (per-call cost depends on leaves, not shapes)
    model = {f"l{i}": jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for i, s in enumerate(shapes)}
    grads = {k: jnp.asarray(rng.standard_normal(v.shape, dtype=np.float32) * 1e-3) for k, v in model.items()}
    n = sum(int(np.prod(s)) for s in shapes)
    wl = workloads.Workload("tiny", {}, model, grads, [], len(shapes), n, f"10 leaves, {n} parameters")
    names = args.candidates.split(",")
    cands = {name: candidates.make(name, wl) for name in names}
    load0 = os.getloadavg()[0]
    res = interleave(cands, args.rounds, args.target)
    res.update(description=f"{wl.description} (5 weight/bias pairs)", loadavg=[load0, os.getloadavg()[0]])
    return res


def setup_time(args) -> dict:
    from . import workloads

    import jax
    import optax
    import optim

    wl = workloads.build("10000x1.6k", quick=args.quick)
    model = wl.model
    rule, tx = optim.Adam(1e-3), optax.adam(1e-3)
    out: dict = {"optim.setup": [], "optax init": []}
    jax.block_until_ready(optim.setup(rule, model))     # warm caches (first-use costs of jnp.zeros_like etc.)
    jax.block_until_ready(tx.init(model))
    for r in range(args.rounds):
        for name in (["optim.setup", "optax init"] if r % 2 == 0 else ["optax init", "optim.setup"]):
            if not args.quick:
                gc.collect()
            t0 = time.perf_counter()
            s = optim.setup(rule, model) if name == "optim.setup" else tx.init(model)
            jax.block_until_ready(s)
            out[name].append(time.perf_counter() - t0)
            del s
    return {"samples": out, "description": wl.description, "n_leaves": wl.n_positions}


def quick_all(args) -> dict:
    """`--quick`: every section in one process (startup and imports dominate at tiny sizes)."""
    if "torch" in args.candidates:
        import torch

        torch.set_num_threads(1)        # tiny tensors + a busy 2-core machine: OpenMP barriers dominate
    out = steps(args)
    out = out if "multi" in out else {"multi": {args.workload: out}}
    if args.overhead_candidates:
        args.candidates = args.overhead_candidates
        out["overhead"] = overhead(args)
    out["setup"] = setup_time(args)
    return out


def _volunteer_for_oom_killer() -> None:
    """The 10000-leaf compiles can exhaust memory: make sure the kernel kills this process, not a neighbour."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def main(argv=None) -> None:
    _volunteer_for_oom_killer()
    ap = argparse.ArgumentParser(prog="python -m bench.worker")
    ap.add_argument("mode", choices=["first", "steps", "overhead", "setup", "quick"])
    ap.add_argument("--workload")
    ap.add_argument("--candidate")
    ap.add_argument("--candidates")
    ap.add_argument("--overhead-candidates", default="")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--target", type=float, default=0.2, help="seconds per timed sample")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    fn = {"first": first, "steps": steps, "overhead": overhead, "setup": setup_time, "quick": quick_all}[args.mode]
    _emit(fn(args))


if __name__ == "__main__":
    main()
