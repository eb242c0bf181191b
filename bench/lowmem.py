"""Low-memory optimiser state: quality, bytes and speed of quantised moments and stochastic rounding.

    python -m bench.lowmem --maps                # ~45 minutes on 2 CPU cores: bench/LOWMEM.md (+ .json)
    python -m bench.lowmem --quick --out /tmp/LOWMEM.md     # a minute: the suite's smoke run

Models: the demo's tied character LM (`examples/train_tied_lm.py`, "small": width 128, 2 layers) and a larger
GPT-style one (width 256, 4 layers, context 64), trained on the same batches in one process with
`chain(ClipGlobalNorm(1), AdamW(warmup_cosine, weight_decay=0.1))` whose moments are float32, bfloat16, `q8`
or `q4`; and on bfloat16 parameters with `StochasticRounding(rule)` against `MixedPrecision(float32, rule)` (a
float32 master copy) and plain bfloat16 updates. Reported: the held-out loss at the end (mean over fixed
batches), the optimiser state's bytes per parameter (`optim.state_bytes`), and the optimiser step's time on
the model's real gradients relative to float32 AdamW's, on XLA's path (`OPTIM_FUSED` off) and against the
fused CPU kernel (interleaved rounds, median). `--maps` also trains with other code maps (mantissa bits) for
the 4-bit and 8-bit formats, each in a process of its own: the measurement behind
`optim._rules.quantized.MANTISSA`; `--maps-only` adds them to an existing `.json` and rewrites the report.
`--seeds N` trains every run from N initialisations and batch orders and reports the mean held-out loss: at
300 steps two runs of one configuration differ by a few per cent, more than most formats differ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import optim
from optim._engine import fused

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train_tied_lm as lm  # noqa: E402

MODELS = {
    "demo LM": dict(d=128, layers=2, heads=4, ctx=128, batch=32),
    "GPT-style": dict(d=256, layers=4, heads=8, ctx=64, batch=16),
    "quick": dict(d=32, layers=1, heads=2, ctx=16, batch=4),
}


def adamw(steps: int, mu=None, nu=None) -> optim.Rule:
    sched = optim.warmup_cosine(3e-3, max(steps // 10, 1), max(steps, 2), final=3e-4)
    return optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(sched, weight_decay=0.1, mu_dtype=mu, nu_dtype=nu))


def configs(steps: int) -> list[tuple[str, str, object]]:
    """(name, parameter dtype, rule) per run."""
    out = [("AdamW float32", "float32", adamw(steps)),
           ("AdamW bfloat16 m, v", "float32", adamw(steps, jnp.bfloat16, jnp.bfloat16)),
           ("AdamW q8", "float32", adamw(steps, optim.q8, optim.q8)),
           ("AdamW q4", "float32", adamw(steps, optim.q4, optim.q4)),
           ("bf16 params, float32 master copy", "bfloat16", optim.MixedPrecision(jnp.float32, adamw(steps))),
           ("bf16 params, plain", "bfloat16", adamw(steps))]
    if hasattr(optim, "StochasticRounding"):
        out.append(("bf16 params, StochasticRounding", "bfloat16", optim.StochasticRounding(adamw(steps))))
    return out


# Other code maps (bits, signed, mantissa bits), each trained in a process of its own: the map is read when a
# step is traced, and optim keeps traced programs by the rule's structure, which the map is not part of.
MAP_VARIANTS = [(4, False, 0), (4, False, 2), (4, True, 0), (8, False, 4), (8, True, 2)]


def map_run(model: str, steps: int, bits: int, signed: bool, mantissa: int) -> dict:
    """`AdamW q<bits>` on `model` with the signed or unsigned map's mantissa bits set to `mantissa`, in a new
    process."""
    code = (f"import json, sys; from bench import lowmem as L; from optim._rules import quantized as Q; "
            f"Q.MANTISSA[({bits}, {signed})] = {mantissa}; "
            f"r = L.run_one({model!r}, {steps}, 'AdamW q{bits}'); print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_one(model: str, steps: int, name: str) -> dict:
    ids, vocab = lm.load_text(lm.HERE / "data" / "shakespeare.txt")
    rule, dtype = {n: (r, d) for n, d, r in configs(steps)}[name]
    r = train(MODELS[model], steps, rule, dtype, ids, len(vocab))
    r["bytes_per_param"] = r["bytes"] / n_params(r.pop("state"))
    return r


def train(cfg: dict, steps: int, rule, dtype: str, ids, vocab: int, seed: int = 0) -> dict:
    params = lm.init_params(jax.random.key(seed), vocab, **cfg)
    params = optim.retie(optim.setup(optim.Descent(), params), jax.tree.map(lambda a: a.astype(dtype), params))
    state = optim.setup(rule, params)
    heads = cfg["heads"]

    @jax.jit
    def step(state, params, x, y):
        loss, g = jax.value_and_grad(lm.loss_fn)(params, x, y, heads)
        state, params = optim.update(state, params, g)
        return state, params, loss

    evaluate = jax.jit(lambda p, x, y: lm.loss_fn(jax.tree.map(lambda a: a.astype(jnp.float32), p), x, y, heads))
    data = lm.batches(ids[: len(ids) * 9 // 10], cfg["batch"], cfg["ctx"], np.random.default_rng(seed))
    held = lm.batches(ids[len(ids) * 9 // 10:], cfg["batch"], cfg["ctx"], np.random.default_rng(seed + 1))
    held = [next(held) for _ in range(8)]
    curve = []
    t0 = time.perf_counter()
    for i in range(steps):
        x, y = next(data)
        state, params, loss = step(state, params, x, y)
        curve.append(float(loss))
    val = float(np.mean([evaluate(params, x, y) for x, y in held]))
    return dict(curve=curve, val=val, seconds=time.perf_counter() - t0, bytes=optim.state_bytes(state),
                state=state)


def n_params(state: optim.State) -> int:
    return sum(int(np.prod(p.shape)) for p in state.layout.params)


def step_times(cfg: dict, ids, vocab: int, steps: int, rounds: int, inner: int) -> dict:
    """The optimiser step alone (donated, jitted `optim.update` on one batch's real gradients), median seconds of
    `inner` calls per round over `rounds` interleaved rounds; AdamW's float32 and quantised moments on XLA's path
    and in the fused CPU kernel."""
    params = lm.init_params(jax.random.key(0), vocab, **cfg)
    x, y = next(lm.batches(ids, cfg["batch"], cfg["ctx"], np.random.default_rng(0)))
    g = jax.grad(lm.loss_fn)(params, x, y, cfg["heads"])
    runs = {"AdamW float32 (fused CPU kernel)": (adamw(steps), True),
            "AdamW float32": (adamw(steps), False),
            "AdamW bfloat16 m, v": (adamw(steps, jnp.bfloat16, jnp.bfloat16), False),
            "AdamW q8 (fused CPU kernel)": (adamw(steps, optim.q8, optim.q8), True),
            "AdamW q8": (adamw(steps, optim.q8, optim.q8), False),
            "AdamW q4 (fused CPU kernel)": (adamw(steps, optim.q4, optim.q4), True),
            "AdamW q4": (adamw(steps, optim.q4, optim.q4), False)}
    live = {}
    for name, (rule, kernel) in runs.items():
        fused.ENABLED = kernel
        # A jit of its own per row: one jit of optim.update would trace once for the rows of one structure, and
        # the switch read when traced (fused.ENABLED) would not tell the kernel's rows from XLA's.
        step = jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1))
        state = optim.setup(rule, params)
        s, m = step(state, optim.donatable(state, jax.tree.map(jnp.copy, params)), g)      # compile
        live[name] = (s, m, kernel, step)
    times: dict = {k: [] for k in runs}
    for _ in range(rounds):
        for name, (s, m, kernel, step) in live.items():
            fused.ENABLED = kernel
            jax.block_until_ready((s, m))
            t0 = time.perf_counter()
            for _ in range(inner):
                s, m = step(s, m, g)
            jax.block_until_ready((s, m))
            times[name].append((time.perf_counter() - t0) / inner)
            live[name] = (s, m, kernel, step)
    fused.ENABLED = True
    return {k: float(np.median(v)) for k, v in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--models", default="demo LM,GPT-style")
    p.add_argument("--maps", action="store_true", help="also train with other code maps (on the first model)")
    p.add_argument("--maps-only", action="store_true", help="only the code maps, into the .json's 'maps'")
    p.add_argument("--quick", action="store_true", help="tiny model, 6 steps, one timing round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seeds", type=int, default=1, help="train each run with this many seeds (mean loss)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "LOWMEM.md")
    p.add_argument("--figure", type=Path, default=ROOT / "docs" / "images" / "lowmem-loss.png",
                   help="the loss curves' figure for the docs (not written with --quick)")
    a = p.parse_args(argv)
    models = ["quick"] if a.quick else a.models.split(",")
    steps = 6 if a.quick else a.steps
    results: dict = {"steps": steps, "jax": jax.__version__, "models": {}}
    if not a.maps_only:
        ids, vocab = lm.load_text(lm.HERE / "data" / "shakespeare.txt")
        for model in models:
            cfg = MODELS[model]
            rows = {}
            for name, dtype, rule in configs(steps):
                r = train(cfg, steps, rule, dtype, ids, len(vocab))
                r["bytes_per_param"] = r["bytes"] / n_params(r.pop("state"))
                if a.seeds > 1:      # other initialisations and batches: the held-out loss's spread
                    r["val_seeds"] = [r["val"]] + [train(cfg, steps, rule, dtype, ids, len(vocab), seed=k)["val"]
                                                   for k in range(1, a.seeds)]
                    r["val"] = float(np.mean(r["val_seeds"]))
                rows[name] = r
                print(f"{model:10s} {name:40s} val {r['val']:.4f}  {r['bytes_per_param']:.2f} B/param  "
                      f"{r['seconds']:.0f} s", flush=True)
            times = step_times(cfg, ids, len(vocab), steps, 1 if a.quick else a.rounds, 1 if a.quick else 5)
            results["models"][model] = dict(cfg=cfg, runs=rows, step_seconds=times)
    else:
        results = json.loads(a.out.with_suffix(".json").read_text())
        for m in results["models"].values():      # runs of other maps made in one process before: not kept
            m["runs"] = {k: v for k, v in m["runs"].items() if " map " not in k}
    if a.maps or a.maps_only or a.quick:
        model = models[0]
        variants = MAP_VARIANTS[:1] if a.quick else MAP_VARIANTS
        results["maps"] = {"model": model, "runs": {}}
        for bits, signed, m in variants:
            r = map_run(model, steps, bits, signed, m)
            key = f"q{bits}, {'signed (m)' if signed else 'unsigned (v)'} map with {m} mantissa bits"
            results["maps"]["runs"][key] = r
            print(f"{model:10s} {key:40s} val {r['val']:.4f}", flush=True)
    write(results, a.out, None if a.quick else a.figure)


def write(results: dict, out: Path, figure: Path | None = None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = ["# Low-memory optimiser state (`python -m bench.lowmem`)", "",
             f"jax {results['jax']}, CPU (2 cores), {results['steps']} training steps per run, same batches; "
             "held-out loss: mean over 8 fixed batches of the last tenth of the text.", ""]
    for model, m in results["models"].items():
        runs = m["runs"]
        base = runs["AdamW float32"]["val"]
        seeds = max(len(r.get("val_seeds", [0])) for r in runs.values())
        lines += [f"## {model} ({', '.join(f'{k} {v}' for k, v in m['cfg'].items())})", "",
                  f"| run | held-out loss{f' (mean of {seeds} seeds: each)' if seeds > 1 else ''} | "
                  "vs float32 AdamW | state bytes / parameter |", "|---|---:|---:|---:|"]
        for name, r in runs.items():
            each = f" ({', '.join(f'{v:.4f}' for v in r['val_seeds'])})" if "val_seeds" in r else ""
            lines.append(f"| {name} | {r['val']:.4f}{each} | {100 * (r['val'] / base - 1):+.2f}% | "
                         f"{r['bytes_per_param']:.2f} |")
        t = m["step_seconds"]
        ref = t["AdamW float32"]
        lines += ["", "Optimiser step alone (donated jitted `optim.update`, median of interleaved rounds):", "",
                  "| run | ms | vs float32 AdamW on XLA's path |", "|---|---:|---:|"]
        lines += [f"| {k} | {1e3 * v:.2f} | {v / ref:.2f}x |" for k, v in t.items()]
        lines.append("")
    if results.get("maps"):
        mp = results["maps"]
        base = results["models"][mp["model"]]["runs"]
        lines += [f"## Code maps ({mp['model']}, AdamW)", "",
                  "Mantissa bits of the log-linear maps (`optim._rules.quantized.MANTISSA`: 3 for both 8-bit maps, "
                  "1 for both 4-bit maps), one map changed at a time:", "",
                  "| map | held-out loss | vs the same format's default maps |", "|---|---:|---:|"]
        for name, r in mp["runs"].items():
            ref = base["AdamW q" + name[1]]["val"]
            lines.append(f"| {name} | {r['val']:.4f} | {100 * (r['val'] / ref - 1):+.2f}% |")
        lines.append("")
    out.write_text("\n".join(lines))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    from .figures import lowmem_loss   # the figure bench/figures.py draws again from bench/LOWMEM.json

    lowmem_loss(figure or out.with_suffix(".png"), results)


if __name__ == "__main__":
    main()
