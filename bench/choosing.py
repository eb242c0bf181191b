"""A small measured comparison of optimisers on the demo LM, for the docs guide "Choosing an optimiser".

    python -m bench.choosing                      # the docs table: writes bench/CHOOSING.md and CHOOSING.json
    python -m bench.choosing --steps 30 --size tiny --out /tmp/CHOOSING.md     # seconds (what the test runs)

The model and data are the demo's (`examples/train_tied_lm.py`: a character-level pre-LayerNorm transformer whose
input embedding and output projection are one array, trained on `examples/data/shakespeare.txt`), at the size
`--size` (`SIZES` below: the demo's own, plus `docs`, a smaller one, so that the whole comparison fits in a few
minutes on 2 CPU cores). Every optimiser trains the same initial parameters (seed 0) on the same batches, in the
same order, for `--steps` steps, and is evaluated on the demo's held-out batches (the last 5% of the text).

The recipe is the demo's (`make demo`), the same for every optimiser: `ClipGlobalNorm(1.0)` first, then the rule,
whose learning rate follows the demo's `warmup_cosine(peak, warmup, steps, final=peak / 10)` with
`warmup = min(100, steps // 10)`, the peak being each rule's recommended default (`OPTIMISERS`; AdamW's is the
demo's 3e-3 with weight decay 0.1). Two exceptions: Schedule-Free takes the warmup only (it replaces the decay)
and is evaluated at its average, `optim.averaged`; Prodigy and DoG take the schedule with peak 1 (the factor
their estimated step size is multiplied by). The demo's EMA of the parameters is left out (it would add one
parameter's worth of state to every row). No hyperparameter was tuned.

Measured per optimiser:

- the training loss, the mean of the last `k = max(1, min(20, steps // 10))` steps, and the held-out loss at
  the end (Schedule-Free's at `optim.averaged(state, model)`);
- the step time of a jitted train step (`value_and_grad` of the loss and `optim.update`, state and model
  donated) on one fixed batch: rounds in which every optimiser takes `--inner` steps in turn, each round's
  mean step time divided by AdamW's in the same round, and the median of those ratios over `--rounds` rounds
  (with AdamW's absolute median alongside); the first call (trace, compile, one step) of the training run,
  after a warm-up step;
- the optimiser state's bytes over the parameters' bytes: every distinct array in `jax.tree.leaves(state)`
  (the rule's moments, the step counter, the hyperparameters) counted once, over the distinct trainable
  parameters (the tied embedding once).

The process runs XLA:CPU with `PJRT_NPROC=32` threads unless set (see `main`: SOAP's LAPACK calls can otherwise
deadlock on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train_tied_lm.py"
TEXT = ROOT / "examples" / "data" / "shakespeare.txt"

SIZES = {
    #          width, layers, heads, context, batch
    "test":  dict(d=16, layers=1, heads=2, ctx=16, batch=8),        # tests/test_bench.py: seconds
    "tiny":  dict(d=32, layers=2, heads=2, ctx=32, batch=8),        # the demo's tiny
    "docs":  dict(d=64, layers=2, heads=4, ctx=64, batch=16),       # the docs table
    "small": dict(d=128, layers=2, heads=4, ctx=128, batch=32),     # the demo's default (`make demo`)
}

ADAMW_LR, ADAMW_WD = 3e-3, 0.1          # the demo's


def _adamw(sched):
    import optim
    return optim.AdamW(sched(ADAMW_LR), weight_decay=ADAMW_WD)


def _muon(sched, name: str = "Muon"):
    """Muon (or NorMuon) on the blocks' matrices (qkv, proj, w1, w2); the demo's AdamW on the rest: the tied
    embedding (also the output projection), the position embedding, the LayerNorms and the biases (Muon is for
    hidden layers)."""
    import optim
    muon = optim.chain(optim.ClipGlobalNorm(1.0), getattr(optim, name)(sched(0.02)))
    adamw = optim.chain(optim.ClipGlobalNorm(1.0), _adamw(sched))
    return lambda path, x: muon if path.startswith("blocks") and x.ndim == 2 else adamw


OPTIMISERS = {
    # name: (build(sched) -> rule or per-leaf function, the recipe in words, how to build its schedule)
    "AdamW": (_adamw, f"AdamW(lr={ADAMW_LR}, weight_decay={ADAMW_WD}): the demo's", "cosine"),
    "Muon+AdamW": (_muon, "Muon(lr=0.02) on the blocks' matrices, the demo's AdamW on the rest (the tied "
                          "embedding, positions, norms, biases); each clipped on its own", "cosine"),
    "Adafactor": (lambda s: __import__("optim").Adafactor(s(0.01)), "Adafactor(lr=0.01): its default "
                  "(a relative step)", "cosine"),
    "Schedule-Free": (lambda s: __import__("optim").ScheduleFreeAdamW(s(0.0025)), "ScheduleFreeAdamW(lr=0.0025): "
                      "its default, warmup only, evaluated at `optim.averaged`", "warmup"),
    "SOAP": (lambda s: __import__("optim").SOAP(s(0.003)), "SOAP(lr=0.003): its defaults (weight decay 0.01, "
             "preconditioners refreshed every 10 steps)", "cosine"),
    "Prodigy": (lambda s: __import__("optim").Prodigy(s(1.0)), "Prodigy(lr=1.0): the schedule with peak 1 "
                "multiplies its estimated step size", "cosine"),
    "DoG": (lambda s: __import__("optim").DoG(s(1.0)), "DoG(lr=1.0): the schedule with peak 1 multiplies its "
            "step size", "cosine"),
    "NorMuon+AdamW": (lambda s: _muon(s, "NorMuon"), "NorMuon(lr=0.02) on the blocks' matrices, the demo's AdamW "
                      "on the rest, as Muon+AdamW", "cosine"),
    "Shampoo": (lambda s: __import__("optim").Shampoo(s(0.001)), "Shampoo(lr=0.001): its defaults (Adam grafting; "
                "the graft's step until step 101, inverse roots every 100 steps)", "cosine"),
    "Kron": (lambda s: __import__("optim").Kron(s(0.001)), "Kron(lr=0.001): its defaults (the preconditioner "
             "updated every step)", "cosine"),
    "MARS": (lambda s: __import__("optim").MARS(s(0.003)), "MARS(lr=0.003): its defaults (γ 0.025, β (0.95, "
             "0.99))", "cosine"),
}
# Rules that may not exist in every checkout of optim (they were added together with this comparison or later).
OPTIONAL = {"SOAP": "SOAP", "Prodigy": "Prodigy", "DoG": "DoG", "NorMuon+AdamW": "NorMuon", "Shampoo": "Shampoo",
            "Kron": "Kron", "MARS": "MARS"}
REFERENCE = "AdamW"


def available() -> list[str]:
    import optim
    return [n for n in OPTIMISERS if n not in OPTIONAL or hasattr(optim, OPTIONAL[n])]


def demo():
    """The demo script as a module (its model code: init_params, loss_fn, load_text, batches)."""
    spec = importlib.util.spec_from_file_location("train_tied_lm", DEMO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def buffer_bytes(tree) -> int:
    """Bytes of the distinct arrays in `tree`, each counted once."""
    import jax

    seen, total = set(), 0
    for x in jax.tree.leaves(tree):
        if hasattr(x, "nbytes") and id(x) not in seen:
            seen.add(id(x))
            total += int(x.nbytes)
    return total


def schedule(kind: str, steps: int):
    """`peak -> schedule`: the demo's warmup and cosine decay to peak / 10, or (Schedule-Free) the warmup alone."""
    import optim

    warmup = max(1, min(100, steps // 10))
    if kind == "warmup":
        return lambda peak: optim.Join([optim.Linear(0.0, peak, warmup), optim.Constant(peak)], [warmup])
    return lambda peak: optim.warmup_cosine(peak, warmup, max(steps, warmup + 1), final=peak / 10)


_EVAL: dict = {}


def _evaluator(loss_fn, heads):
    """One jitted loss for every run (compiled once per model, not once per optimiser)."""
    import jax
    return _EVAL.setdefault((loss_fn, heads), jax.jit(lambda p, x, y: loss_fn(p, x, y, heads)))


class Run:
    """One optimiser on the shared model and data: its state, its jitted donated step, its losses."""

    def __init__(self, name, mod, params0, cfg, steps):
        import jax
        import jax.numpy as jnp
        import optim

        build, self.recipe, kind = OPTIMISERS[name]
        rule = build(schedule(kind, steps))
        if not callable(rule) or isinstance(rule, optim.Rule):
            rule = optim.chain(optim.ClipGlobalNorm(1.0), rule)
        self.name, self.averaged = name, name == "Schedule-Free"
        heads = cfg["heads"]
        copies: dict = {}                                    # a fresh copy of each distinct array: tie kept
        params = jax.tree.map(lambda a: copies.setdefault(id(a), jnp.array(a, copy=True)), params0)
        state = optim.setup(rule, params)
        assert state.ties() == {"embed": ("unembed",)}, state.ties()
        self.state_bytes = buffer_bytes(state)
        # Both are donated to the step: no buffer may be in both (a rule may keep the parameter itself, Prodigy
        # its x0), nor at two places (the tie: `donatable`). All committed to the device, as the step's outputs
        # are: some rules' setup leaves a few scalars uncommitted, and the second call would compile again.
        dev = jax.devices()[0]
        self.state = jax.device_put(jax.tree.map(lambda a: jnp.array(a, copy=True), state), dev)
        self.params = jax.device_put(optim.donatable(state, params), dev)

        def step(state, params, x, y):
            loss, grads = jax.value_and_grad(mod.loss_fn)(params, x, y, heads)
            state, params = optim.update(state, params, grads)
            return state, params, loss

        self.step = jax.jit(step, donate_argnums=(0, 1))
        self.eval = _evaluator(mod.loss_fn, heads)
        self.losses: list = []
        self.first_s = None

    def train(self, data) -> None:
        import jax

        for i, (x, y) in enumerate(data):
            t0 = time.perf_counter()
            self.state, self.params, loss = self.step(self.state, self.params, x, y)
            if i == 0:
                jax.block_until_ready(loss)
                self.first_s = time.perf_counter() - t0
            self.losses.append(loss)
        self.losses = [float(v) for v in self.losses]

    def eval_params(self):
        import optim
        return optim.averaged(self.state, self.params) if self.averaged else self.params

    def held_out(self, batches) -> float:
        p = self.eval_params()
        return float(sum(float(self.eval(p, x, y)) for x, y in batches) / len(batches))

    def time_steps(self, x, y, n: int) -> float:
        """The mean time of `n` steps on (x, y), one after another, waited for at the end (a mean, not a
        median: SOAP refreshes its bases every 10th step, and 10 steps take exactly one refresh)."""
        import jax

        t0 = time.perf_counter()
        for _ in range(n):
            self.state, self.params, loss = self.step(self.state, self.params, x, y)
        jax.block_until_ready((self.state, self.params, loss))
        return (time.perf_counter() - t0) / n


def measure(names, size, steps, rounds, inner, seed=0, log=print) -> dict:
    import jax
    import numpy as np
    import optim

    mod = demo()
    cfg = dict(SIZES[size])
    ids, vocab = mod.load_text(TEXT)
    split = int(0.95 * len(ids))
    train_ids, val_ids = ids[:split], ids[split:]
    ctx, batch = cfg["ctx"], cfg["batch"]
    params0 = mod.init_params(jax.random.key(seed), len(vocab), **cfg)
    param_bytes = buffer_bytes(optim.trainables(params0))
    n_params = sum(a.size for a in optim.trainables(params0))
    gen = mod.batches(train_ids, batch, ctx, np.random.default_rng(seed))
    data = [next(gen) for _ in range(steps)]
    val_rng = np.random.default_rng(1234)                    # the demo's held-out batches
    val_batches = [next(mod.batches(val_ids, batch, ctx, val_rng)) for _ in range(4)]
    k = max(1, min(20, steps // 10))

    # JAX and XLA start once per process, in its first compile: one throwaway step first, so that each
    # optimiser's first call is its own trace and compile (measured first, AdamW's was 4.5 s against 1.9 s).
    warm = Run(names[0], mod, params0, cfg, steps)
    warm.train(data[:1])
    runs, rows = {}, {}
    for name in names:
        t0 = time.perf_counter()
        run = runs[name] = Run(name, mod, params0, cfg, steps)
        initial = run.held_out(val_batches)
        run.train(data)
        rows[name] = {
            "recipe": run.recipe,
            "initial_loss": initial,
            "first_train_loss": run.losses[0],
            "train_loss": float(np.mean(run.losses[-k:])),
            "held_out_loss": run.held_out(val_batches),
            "first_s": run.first_s,
            "state_bytes": run.state_bytes,
            "state_ratio": run.state_bytes / param_bytes,
            "losses": run.losses,
        }
        r = rows[name]
        log(f"{name:14s} train {r['train_loss']:.3f}  held-out {r['held_out_loss']:.3f}  "
            f"state {r['state_ratio']:.3f}x  first call {r['first_s']:.2f} s  ({time.perf_counter() - t0:.0f} s)")

    # Step time: interleaved rounds on one fixed batch, each round's ratio to AdamW's step in the same round.
    ref = REFERENCE if REFERENCE in names else names[0]
    x, y = data[0]
    for run in runs.values():
        run.time_steps(x, y, 2)                              # warm
    per_round = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            per_round[n].append(runs[n].time_steps(x, y, inner))
    for n in names:
        ratios = [a / b for a, b in zip(per_round[n], per_round[ref])]
        rows[n]["step_s"] = statistics.median(per_round[n])
        rows[n]["step_ratio"] = statistics.median(ratios)
        rows[n]["step_ratio_range"] = [min(ratios), max(ratios)]
    return {"size": size, "config": cfg, "steps": steps, "k": k, "rounds": rounds, "inner": inner, "seed": seed,
            "reference": ref, "n_params": int(n_params), "param_bytes": param_bytes, "vocab": len(vocab),
            "rows": rows}


def machine_line() -> str:
    import jax

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", ""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os
    import optim
    return (f"Machine: {cpu}, {os.cpu_count()} CPU cores (shared with other work while measured), "
            f"{jax.default_backend()}; jax {jax.__version__}, optim {optim.__version__} at commit {commit}"
            f"{' with uncommitted changes' if dirty else ''}; {datetime.date.today().isoformat()}.")


def report(res: dict) -> str:
    cfg, rows, ref = res["config"], res["rows"], res["reference"]
    lines = [
        "| optimiser | train loss | held-out loss | step time vs AdamW | first call | state / parameters |",
        "|---|---|---|---|---|---|",
    ]
    for n, r in rows.items():
        lo, hi = r["step_ratio_range"]
        lines.append(f"| {n} | {r['train_loss']:.3f} | {r['held_out_loss']:.3f} | {r['step_ratio']:.2f}x "
                     f"({lo:.2f}-{hi:.2f}) | {r['first_s']:.1f} s | {r['state_ratio']:.2f}x |")
    recipes = "\n".join(f"- {n}: {r['recipe']}." for n, r in rows.items())
    start = statistics.median(r["initial_loss"] for r in rows.values())
    adafactor_note = ""
    if "Adafactor" in rows and cfg["d"] < 128:           # every matrix has an axis of length d
        adafactor_note = (
            f"\nAt width {cfg['d']} Adafactor factors no matrix (it needs two axes of at least 128 entries, its\n"
            "`min_dim_size_to_factor`): its state here is a full second moment without momentum, half of\n"
            "AdamW's; on a model with wider matrices it holds a row and a column per matrix.")
    return f"""# Choosing an optimiser: a measured comparison (`python -m bench.choosing`)

<!-- docs/guides/choosing.md includes what is between these markers -->
<!-- --8<-- [start:results] -->
The demo's tied character LM (`examples/train_tied_lm.py`) at width {cfg['d']}, {cfg['layers']} layers,
{cfg['heads']} heads, context {cfg['ctx']}, batch {cfg['batch']} ({res['n_params']:,} parameters, the tied
embedding once), trained for {res['steps']} steps by each optimiser from the same initial parameters on the same
batches of `examples/data/shakespeare.txt`. Loss in nats per character: {start:.3f} at the start
(uniform guess: {math.log(res['vocab']):.3f}).

{chr(10).join(lines)}

- train loss: the mean of the last {res['k']} steps' training losses; held-out loss: on the demo's 4 held-out
  batches after the last step (Schedule-Free's at `optim.averaged`, the point it is meant to be evaluated at).
- step time: a jitted step (`value_and_grad` and `optim.update`, state and model donated) on one batch,
  {res['rounds']} rounds of {res['inner']} steps per optimiser, interleaved; each round's mean step time over
  {ref}'s in the same round, the median of those ratios (their range in brackets). {ref}'s step:
  {rows[ref]['step_s'] * 1e3:.1f} ms.
- first call: trace, compile and one step, after a throwaway step of the first optimiser's (JAX and XLA
  start in a process's first compile, which would be charged to the first row).
- state / parameters: the bytes of the distinct arrays in the optimiser state (moments, counters,
  hyperparameters) over the bytes of the distinct parameters.

Method: every optimiser runs the demo's recipe, `ClipGlobalNorm(1.0)` then the rule, its learning rate on the
demo's warmup (10% of the steps) and cosine decay to a tenth, the peak being the rule's default, not tuned:

{recipes}

One small model, one seed, {res['steps']} steps, on a CPU shared with other work: the losses say which rules
make progress on this problem with their defaults, not which is best on yours; the step times are ratios so that
the machine's drift cancels, and they depend on the model's shapes (SOAP's eigendecompositions and Muon's
Newton-Schulz iterations grow with the matrices' sizes, the elementwise rules with the number of entries).
{adafactor_note}

{res.get("machine") or machine_line()}
<!-- --8<-- [end:results] -->
"""


def main(argv=None) -> dict:
    # Before jax starts: XLA:CPU's thread pool is one thread per core by default, and a LAPACK call (SOAP's QR and
    # eigh) on one of its threads waits for work it queues on the same pool; two such calls at once on 2 cores
    # wait for each other for ever (seen in SOAP's refresh, jaxlib 0.10). More threads than cores avoid it, as in
    # tests/parallel_cases.py.
    import os
    os.environ.setdefault("PJRT_NPROC", str(max(32, os.cpu_count() or 1)))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps per optimiser (default 300)")
    p.add_argument("--size", choices=sorted(SIZES), default="docs", help="model size (default docs)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    p.add_argument("--inner", type=int, default=10, help="timed steps per optimiser per round (default 10)")
    p.add_argument("--only", default=None, help="comma-separated optimiser names (default: every available one)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "CHOOSING.md", help="the markdown report; the "
                   "JSON beside it")
    p.add_argument("--report-only", action="store_true", help="rewrite --out from the JSON beside it, "
                   "measuring nothing")
    args = p.parse_args(argv)
    if args.report_only:
        res = json.loads(args.out.with_suffix(".json").read_text())
        args.out.write_text(report(res))
        return res
    names = available()
    if args.only:
        want = [s.strip() for s in args.only.split(",")]
        unknown = sorted(set(want) - set(OPTIMISERS))
        if unknown:
            raise SystemExit(f"--only: unknown {unknown}; known: {sorted(OPTIMISERS)}")
        names = [n for n in names if n in want]
    missing = [n for n in OPTIMISERS if n not in available()]
    if missing:
        print(f"not in this optim (skipped): {', '.join(missing)}")
    res = measure(names, args.size, args.steps, args.rounds, args.inner)
    res["machine"] = machine_line()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(res))
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return res


if __name__ == "__main__":
    main()
