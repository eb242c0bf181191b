"""`python -m bench.gpu [--quick] [--rounds N] [--sizes ...] [--json OUT] [--md OUT]`: optimiser steps on the
default device (a GPU where JAX has one), optim against optax and torch, in one process with interleaved rounds.

What issue 38 measured on an H200 by hand, as one prepared run (`bench/GPU.md` holds its results), after a
check of optim's own GPU kernels against XLA's path on the device (`check_kernels`: the one-pass quantised
AdamW step; a difference there is a bug to report before any timing):

- Workloads: `1x16M` (one 4096x4096 leaf), `100x160k` (100 leaves of 400x400), `1000x16k` (1000 of 128x128):
  the same 16M float32 parameters in 1, 100 and 1000 leaves. `--quick` keeps the leaf counts' order of magnitude
  at tiny sizes (for a check on CPU; numbers meaningless).
- Candidates, each a jitted step `(state, params, grads) -> (state, params)` donating state and parameters, with
  its optax counterpart: Adam (`optax.adam`, the reference of every ratio), AdamW, `chain(ClipGlobalNorm,
  AdamW)`, `SkipNonFinite(AdamW)` (`optax.apply_if_finite`), `EMA(AdamW)` (`optax.adamw` plus an EMA of the new
  parameters), Adam with bfloat16 moments (optax: `mu_dtype` only, it has no `nu_dtype`), AdamW with q8 moments
  (optim only); torch's fused Adam on the same device where torch is installed (CUDA when JAX's device is a
  GPU and torch has CUDA; else torch's CPU `foreach` Adam); and a probe `p += g` (the bandwidth floor: 12 bytes
  a parameter against Adam's 28).
- Per candidate: the median time of a step over `--rounds` rounds (the order rotates every round), its ratio to
  optax's Adam, the first call (trace, compile and run), the compiled program's kernels (`bench.kernels`'
  count: fusions, library calls, copies) and XLA's temporary buffer (`memory_analysis`); per workload the
  device's peak memory (`memory_stats`, where the device reports it: a process-wide high-water mark).

Run it on a GPU as one script (`tests/test_bench.py` runs `--quick` on CPU):

    python -m bench.gpu --md bench/GPU.md --json bench/GPU.json
    python -m bench.step --only gpt-110m --out "$OUT/step/RESULTS.md"    # the whole GPT step, first-call times

the second writes its section (optim's production stack against optax's and torch's, its first calls and peak
memory) to a results file of its own, to be copied into `bench/GPU.md`: `bench/STEP.json` and `bench/RESULTS.md`
hold the CPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .worker import interleave

HERE = Path(__file__).resolve().parent
SIZES = {"1x16M": (1, (4096, 4096)), "100x160k": (100, (400, 400)), "1000x16k": (1000, (128, 128))}
QUICK = {"1x16M": (1, (256, 256)), "100x160k": (20, (100, 100)), "1000x16k": (100, (16, 16))}
REFERENCE = "optax Adam"


def rules() -> dict:
    """name -> (optim rule or None, optax transformation or None)."""
    import jax.numpy as jnp
    import optax
    import optim

    from .kernels import _optax_ema

    bf16, wd = jnp.bfloat16, 0.1
    return {
        "Adam": (optim.Adam(1e-3), optax.adam(1e-3)),
        "AdamW": (optim.AdamW(1e-3, weight_decay=wd), optax.adamw(1e-3, weight_decay=wd)),
        "clip+AdamW": (optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(1e-3, weight_decay=wd)),
                       optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=wd))),
        "SkipNonFinite(AdamW)": (optim.SkipNonFinite(optim.AdamW(1e-3, weight_decay=wd)),
                                 optax.apply_if_finite(optax.adamw(1e-3, weight_decay=wd), 100)),
        "EMA(AdamW)": (optim.EMA(optim.AdamW(1e-3, weight_decay=wd), 0.999),
                       _optax_ema(optax.adamw(1e-3, weight_decay=wd), 0.999)),
        "Adam bf16 moments": (optim.Adam(1e-3, mu_dtype=bf16, nu_dtype=bf16), optax.adam(1e-3, mu_dtype=bf16)),
        "AdamW q8": (optim.AdamW(1e-3, weight_decay=wd, mu_dtype=optim.q8, nu_dtype=optim.q8), None),
    }


class JaxStep:
    """A jitted step `fn(state, params, grads) -> (state, params)` donating state and parameters."""

    def __init__(self, name: str, fn, state, params, grads):
        import jax

        self.name, self.state, self.params, self.grads = name, state, params, grads
        jitted = jax.jit(fn, donate_argnums=(0, 1))
        t = time.perf_counter()
        compiled = jitted.lower(state, params, grads).compile()
        self.compile_s = time.perf_counter() - t
        self.kernels = _kernels(compiled.as_text())
        mem = compiled.memory_analysis()
        self.temp_mb = None if mem is None else mem.temp_size_in_bytes / 2**20
        self._fn = compiled
        t = time.perf_counter()
        self.step()
        self.block()
        self.first_s = self.compile_s + time.perf_counter() - t

    def step(self):
        self.state, self.params = self._fn(self.state, self.params, self.grads)

    def block(self):
        import jax
        jax.block_until_ready((self.state, self.params))


class TorchAdam:
    """torch's fused Adam (multi-tensor, one launch per chunk of tensors) on the same parameters."""

    def __init__(self, arrays: list, cuda: bool):
        import torch

        self.name, self.first_s, self.kernels, self.temp_mb = "torch Adam fused", None, None, None
        dev = "cuda" if cuda else "cpu"
        self._torch, self._cuda = torch, cuda
        self.params = [torch.tensor(np.asarray(a), device=dev, requires_grad=True) for a in arrays]
        for p in self.params:
            p.grad = torch.full_like(p, 1e-3)
        kw = {"fused": True} if cuda else {"foreach": True}
        if not cuda:
            self.name = "torch Adam foreach (CPU)"
        self.opt = torch.optim.Adam(self.params, lr=1e-3, **kw)
        t = time.perf_counter()
        self.step()
        self.block()
        self.first_s = time.perf_counter() - t

    def step(self):
        self.opt.step()

    def block(self):
        if self._cuda:
            self._torch.cuda.synchronize()


def _kernels(text: str) -> int | None:
    from .kernels import entry_kernels

    try:
        return entry_kernels(text)["kernels"]
    except Exception:      # noqa: BLE001 (a backend whose program text has no ENTRY: no count)
        return None


def candidates(n: int, shape: tuple, torch: bool) -> dict:
    """name -> candidate, each with its own copy of the parameters; the gradients are shared."""
    import jax
    import jax.numpy as jnp
    import optim

    from .kernels import optax_step, optim_step

    keys = jax.random.split(jax.random.key(0), n)
    base = {f"w{i:04d}": jax.random.normal(k, shape, jnp.float32) for i, k in enumerate(keys)}
    grads = jax.tree.map(lambda a: 1e-3 * a, base)

    def fresh():
        return jax.tree.map(jnp.copy, base)

    out = {}
    for name, (rule, tx) in rules().items():
        if tx is not None:
            p = fresh()
            out[f"optax {name}"] = JaxStep(f"optax {name}", optax_step(tx), tx.init(p), p, grads)
        if rule is not None:
            p = fresh()
            out[f"optim {name}"] = JaxStep(f"optim {name}", optim_step, optim.setup(rule, p), p, grads)
    p = fresh()
    out["probe p += g"] = JaxStep("probe p += g", lambda s, q, g: (s, jax.tree.map(jnp.add, q, g)), (), p, grads)
    if torch:
        try:
            import torch as _t
            cuda = jax.default_backend() == "gpu" and _t.cuda.is_available()
            t = TorchAdam(list(base.values()), cuda)
            out[t.name] = t
        except ImportError:
            pass
    return out


def peak_mb() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**20


def run(sizes: dict, rounds: int, target: float, torch: bool, log=print) -> dict:
    import jax

    out = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
           "jax": jax.__version__, "commit": _commit(), "rounds": rounds, "workloads": {}}
    for size, (n, shape) in sizes.items():
        cands = candidates(n, shape, torch)
        res = interleave(dict(cands), rounds, target)["samples"]
        rows = {}
        for name, c in cands.items():
            samples = res.get(name)
            t = statistics.median(samples) if isinstance(samples, list) and samples else None
            rows[name] = {"step_ms": None if t is None else t * 1e3, "first_s": c.first_s, "kernels": c.kernels,
                          "temp_mb": c.temp_mb, "error": samples if isinstance(samples, str) else None}
        ref = rows[REFERENCE]["step_ms"]
        for r in rows.values():
            r["ratio"] = None if r["step_ms"] is None or not ref else r["step_ms"] / ref
        out["workloads"][size] = {"leaves": n, "shape": list(shape), "rows": rows, "peak_mb": peak_mb()}
        log(f"{size}: " + ", ".join(f"{k} {v['ratio']:.2f}" for k, v in rows.items() if v["ratio"] is not None))
        del cands
    return out


def check_kernels(n: int = 1 << 20, steps: int = 5) -> dict:
    """optim's own GPU kernels against XLA's path on this device, before anything is timed: AdamW with q8 and q4
    moments (optim._engine.onepass, a Pallas kernel where the device is a GPU) on one parameter of `n` numbers,
    `steps` steps each way. Per format: whether the kernel is in the program, the largest difference of the
    parameters relative to their scale, and the largest difference of a moment's codes."""
    import jax
    import jax.numpy as jnp
    import optim
    from optim._engine import onepass

    keys = jax.random.split(jax.random.key(0), steps + 1)
    x0 = {"w": jax.random.normal(keys[0], (n // 1024, 1024))}
    out, was = {}, onepass.ENABLED
    try:
        for fmt in ("q8", "q4"):
            q = getattr(optim, fmt)
            rule = optim.AdamW(1e-3, weight_decay=0.1, mu_dtype=q, nu_dtype=q)
            got = {}
            for on in (True, False):
                onepass.ENABLED = on
                state, x = optim.setup(rule, x0), x0
                for t in range(steps):
                    state, x = optim.update(state, x, {"w": jax.random.normal(keys[t + 1], x0["w"].shape)})
                got[on] = (state, x)
            onepass.ENABLED = True
            text = jax.jit(optim.update).lower(optim.setup(rule, x0), x0, x0).as_text()
            (s1, x1), (s0, x0_) = got[True], got[False]
            codes = [(a.astype(jnp.int32) - b.astype(jnp.int32)) for a, b in
                     zip(jax.tree.leaves(s1), jax.tree.leaves(s0)) if a.dtype == jnp.uint8]
            out[f"AdamW {fmt}"] = {
                "kernel": "triton" in text,
                "param_rel": float(jnp.max(jnp.abs(x1["w"] - x0_["w"])) / jnp.max(jnp.abs(x0_["w"]))),
                "code_max": int(max(int(jnp.max(jnp.abs(c))) for c in codes))}
    finally:
        onepass.ENABLED = was
    return out


def markdown(data: dict) -> str:
    lines = [f"Device: {data['device']} ({data['backend']}), jax {data['jax']}, optim at {data['commit']}; "
             f"median of {data['rounds']} interleaved rounds, each ratio to `optax.adam` in the same process.", ""]
    if data.get("checks"):
        lines += ["optim's kernels against XLA's path on this device (5 steps of one parameter):", "",
                  "| step | kernel ran | parameters, largest difference / scale | codes, largest difference |",
                  "|---|---|---:|---:|"]
        lines += [f"| {k} | {c['kernel']} | {c['param_rel']:.1e} | {c['code_max']} |"
                  for k, c in data["checks"].items()]
        lines.append("")
    for size, w in data["workloads"].items():
        peak = "" if w["peak_mb"] is None else f"; device peak {w['peak_mb']:.0f} MB"
        lines += [f"### {size} ({w['leaves']} x {'x'.join(map(str, w['shape']))}{peak})", "",
                  "| candidate | step (ms) | ratio | first call (s) | kernels | XLA temp (MB) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, r in w["rows"].items():
            if r["error"]:
                lines.append(f"| {name} | {r['error']} | | | | |")
                continue
            lines.append(f"| {name} | {r['step_ms']:.3f} | {r['ratio']:.2f} | {_f(r['first_s'])} | "
                         f"{'' if r['kernels'] is None else r['kernels']} | {_f(r['temp_mb'], '{:.1f}')} |")
        lines.append("")
    return "\n".join(lines)


def _f(x, fmt: str = "{:.2f}") -> str:
    return "" if x is None else fmt.format(x)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a check on CPU; numbers meaningless)")
    ap.add_argument("--sizes", default=None, help=f"comma-separated: {', '.join(SIZES)} (default all)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--target", type=float, default=0.2, help="seconds a sample (default 0.2)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", help="write the results as JSON to this file")
    ap.add_argument("--md", help="write the results as markdown to this file")
    args = ap.parse_args(argv)
    table = QUICK if args.quick else SIZES
    sizes = {k: table[k] for k in (args.sizes.split(",") if args.sizes else table)}
    checks = check_kernels(1 << 14 if args.quick else 1 << 20)
    print(f"kernel checks: {checks}", file=sys.stderr)
    data = {**run(sizes, args.rounds, args.target, not args.no_torch, log=lambda s: print(s, file=sys.stderr)),
            "checks": checks}
    text = markdown(data)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text("## Optimiser steps on a GPU (`python -m bench.gpu`)\n\n" + text)


if __name__ == "__main__":
    main()
