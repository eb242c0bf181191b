"""`python -m bench.step [--quick] [--only char-lm,gpt12] [--rounds N] [--target S]`: a whole training step.

The figure a user sees: forward, backward and optimiser of a real model in one step, with the production stack
(AdamW + ClipGlobalNorm + SkipNonFinite + an EMA of the parameters), optim against optax and torch.

Workloads (float32, 2 threads of compute on this machine):

- `char-lm`: the demo's tied character LM (`examples/train_tied_lm.py`, its `small` size, the `make demo`
  config): d 128, 2 pre-LN blocks, 4 heads, context 128, batch 32, vocabulary 76 (the characters of
  `examples/data/shakespeare.txt`, batches drawn from that text). `embed` and `unembed` are one array.
- `gpt12`: the same model code (GPT-2-style pre-LN blocks, tied embedding and head) at 12 layers, d 256,
  8 heads, context 128, vocabulary 1024, batch 1 (one 128-token sequence: a step takes ~0.3-0.5 s on the 2
  cores here), on random tokens.

Candidates (each a jitted step of loss, gradient and optimiser, donating params and optimiser state; the
batches cycle through 4 fixed device arrays):

The optimiser settings are the demo's (at its default 600 steps): learning rate `warmup_cosine(3e-3, 60, 600,
final=3e-4)`, weight decay 0.1, clipping at 1.0, EMA decay `Linear(0.5, 0.99, 300)`; each library is given
the same two schedules.

- `optim`: `optim.SkipNonFinite(optim.EMA(optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(lr,
  weight_decay=0.1)), decay=decay))` on the tied model (SkipNonFinite wraps the whole rule, as its docstring and
  the README say; EMA around the chain as in the demo), `optim.update` inside the user's
  `jax.jit(..., donate_argnums=(0, 1))`.
- `optax`: `optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr,
  weight_decay=0.1)), max_consecutive_errors=10**9)` (`lr` = `optax.warmup_cosine_decay_schedule(0, 3e-3, 60,
  600, 3e-4)`; optim's SkipNonFinite has no such limit) plus an EMA of the parameters in the same jitted step,
  `optax.incremental_update(params, ema, 1 - decay(t))` (t counted in the step), kept where `apply_if_finite`
  skipped (`opt_state.last_finite`, as optim's skip leaves the average). The model is the
  untied twin in this suite's sense: no head position, the forward pass reads `params["embed"]` for the output
  projection too (how an optax user ties a weight). Same unique parameters and the same maths as optim's.
- `optax head-copy`: the same optax stack on the model whose head is its own parameter, initialised equal to
  the embedding. NOT the same maths (the two copies get different gradients and drift apart; the global norm
  counts both); timed to show what it costs, its loss trajectory is printed, not checked.
- `torch`: the same model in torch (`head.weight = emb.weight`, `F.scaled_dot_product_attention(is_causal=True)`,
  GELU tanh), eager (no `torch.compile`), `torch.optim.AdamW(fused=True)`, `clip_grad_norm_(1.0)`, the step
  and `torch._foreach_lerp_(ema, params, 1 - decay(t))` only when the returned norm is finite (the two
  schedules in Python, the group's `lr` set before each step).
- `optim AdamW`, `optax adamw`: the bare optimisers (no clip, no skip, no EMA), so that the stack's cost shows.

Before timing, the step process runs CHECK_STEPS steps of every candidate from the same initial parameters on
the same batches and compares the losses with `optax`'s (relative difference, each step): optim's stack and
bare AdamW to 1e-4, torch to 1e-3 (other kernels); it also compares optim's `optim.averaged(state, model)` with
optax's EMA after those steps (their moves from the initial values, to 1e-3 of the largest move). A failed check
makes the command exit 1.

Method: as `python -m bench` (`bench/runner.py`, `bench/worker.py`): one process per workload times all
candidates interleaved round by round (the order rotating), a sample is `reps` back-to-back steps and one
block; ratios are medians of per-round ratios to `optax` with their IQR; first call (trace + compile + one
step) and peak RSS come from a separate process per candidate. Results: `bench/STEP.json`, and the section
"Whole training step" of `bench/RESULTS.md` (replaced in place; `python -m bench` re-renders it from STEP.json).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib.util
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from . import candidates as C
from . import runner
from .worker import MARK, _rss_mb, interleave

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEMO = ROOT / "examples" / "train_tied_lm.py"
TEXT = ROOT / "examples" / "data" / "shakespeare.txt"
JSON_PATH = HERE / "STEP.json"
TITLE = "## Whole training step"

# The demo's optimiser at its default 600 steps (examples/train_tied_lm.py): warmup_cosine(3e-3, 60, 600,
# final=3e-4), weight decay 0.1, clip 1.0, EMA decay Linear(0.5, 0.99, 300).
PEAK, WARMUP, TOTAL, FINAL = 3e-3, 60, 600, 3e-4
DECAY0, DECAY1, DECAY_STEPS = 0.5, 0.99, 300
WD = 0.1
MAX_NORM = 1.0
CHECK_STEPS = 6      # losses at steps 0..5: five after an update
TOL = 1e-4
TOL_TORCH = 1e-3
TOL_EMA = 1e-3       # of the average's largest move in CHECK_STEPS steps (~1e-4: float32 rounding of values ~1)
N_BATCHES = 4

# name -> (full, quick). char-lm full = the demo's "small" size; its vocabulary comes from the text.
WORKLOADS: dict[str, tuple[dict, dict]] = {
    "char-lm": (dict(data="text", d=128, layers=2, heads=4, ctx=128, batch=32),
                dict(data="text", d=32, layers=2, heads=2, ctx=32, batch=8)),
    "gpt12": (dict(data="random", vocab=1024, d=256, layers=12, heads=8, ctx=128, batch=1),
              dict(data="random", vocab=64, d=32, layers=2, heads=2, ctx=16, batch=2)),
    # GPT-2 small's shape (124M parameters, tied), the whole step issue 38 timed on an H200 (float32 here):
    # run only when named (`--only gpt-110m`), on a GPU (`python -m bench.gpu`'s docstring).
    "gpt-110m": (dict(data="random", vocab=50304, d=768, layers=12, heads=12, ctx=512, batch=16),
                 dict(data="random", vocab=64, d=32, layers=2, heads=2, ctx=16, batch=2)),
}
ON_REQUEST = ("gpt-110m",)
STACK = ["optim", "optax", "optax head-copy", "torch"]
BARE = ["optim AdamW", "optax adamw"]
ALL = STACK + BARE
REF = "optax"
CHECKS = [("optim", REF, TOL), ("optim AdamW", "optax adamw", TOL), ("torch", REF, TOL_TORCH)]


# ------------------------------------------------------------------------------------------------ workloads
def demo():
    """The demo script as a module (its model code: init_params, forward, loss_fn, load_text)."""
    spec = importlib.util.spec_from_file_location("train_tied_lm", DEMO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Workload:
    """Initial parameters (numpy, one array per unique parameter, by the demo's `init_params`) and batches."""

    def __init__(self, name: str, quick: bool):
        import jax
        import numpy as np

        self.name, self.quick = name, quick
        cfg = dict(WORKLOADS[name][1 if quick else 0])
        self.demo = demo()
        rng = np.random.default_rng(0)
        if cfg.pop("data") == "text":
            ids, vocab = self.demo.load_text(TEXT)
            cfg["vocab"] = len(vocab)
            starts = rng.integers(0, len(ids) - cfg["ctx"] - 1, size=(N_BATCHES, cfg["batch"]))
            w = ids[starts[..., None] + np.arange(cfg["ctx"] + 1)]
            data = "batches of `examples/data/shakespeare.txt`"
        else:
            w = rng.integers(0, cfg["vocab"], size=(N_BATCHES, cfg["batch"], cfg["ctx"] + 1)).astype(np.int32)
            data = "random tokens"
        self.cfg = cfg
        self.xs, self.ys = w[..., :-1].astype(np.int32), w[..., 1:].astype(np.int32)
        params = self.demo.init_params(jax.random.key(0), **cfg)
        assert params["embed"] is params["unembed"]
        self.init = jax.tree.map(np.asarray, {k: v for k, v in params.items() if k != "unembed"})
        self.n_params = sum(int(a.size) for a in jax.tree.leaves(self.init))
        self.description = (f"vocab {cfg['vocab']}, d {cfg['d']}, {cfg['layers']} layers, {cfg['heads']} heads, "
                            f"context {cfg['ctx']}, batch {cfg['batch']} ({data}); "
                            f"{self.n_params / 1e6:.2f}M parameters, embedding tied to the head")
        self.loss = functools.partial(self.demo.loss_fn, heads=cfg["heads"])

    def tied(self):
        """A fresh device copy of the tied model (embed and unembed ONE array, as the demo builds it)."""
        import jax
        m = jax.tree.map(lambda a: jax.device_put(a.copy()), self.init)
        m["unembed"] = m["embed"]
        return m

    def twin(self):
        """The untied twin without a head position (the forward reads embed for the head)."""
        import jax
        return jax.tree.map(lambda a: jax.device_put(a.copy()), self.init)

    def twin_loss(self, params, x, y):
        return self.loss(dict(params, unembed=params["embed"]), x, y)

    def head_copy(self):
        """The head as its own parameter, initialised equal to the embedding."""
        m = self.twin()
        m["unembed"] = C._copy(m["embed"])
        return m


_WL: dict = {}


def workload(name: str, quick: bool) -> Workload:
    if (name, quick) not in _WL:
        _WL[name, quick] = Workload(name, quick)
    return _WL[name, quick]


# ------------------------------------------------------------------------------------------------ candidates
class JaxStep(C.Candidate):
    """A jitted, donating training step `fn(params, opt, x, y) -> (params, opt, loss)` over cycling batches."""

    def __init__(self, name, wl, params, opt, fn):
        import jax

        self.name, self.params, self.opt = name, params, opt
        self._fn = jax.jit(fn, donate_argnums=(0, 1))
        self._xs = [jax.device_put(x) for x in wl.xs]
        self._ys = [jax.device_put(y) for y in wl.ys]
        self.i, self.loss = 0, None

    def step(self):
        k = self.i % N_BATCHES
        self.params, self.opt, self.loss = self._fn(self.params, self.opt, self._xs[k], self._ys[k])
        self.i += 1
        return self.loss

    def block(self):
        import jax
        jax.block_until_ready((self.params, self.opt, self.loss))

    def state_bytes(self):
        return C.tree_bytes(self.opt)


def optim_rule(stack: bool):
    import optim

    adamw = optim.AdamW(optim.warmup_cosine(PEAK, WARMUP, TOTAL, final=FINAL), weight_decay=WD)
    if not stack:
        return adamw
    decay = optim.Linear(DECAY0, DECAY1, DECAY_STEPS)
    return optim.SkipNonFinite(optim.EMA(optim.chain(optim.ClipGlobalNorm(MAX_NORM), adamw), decay=decay))


def make_optim(name, wl, stack: bool):
    import jax
    import optim

    model = wl.tied()
    state = optim.setup(optim_rule(stack), model)             # finds the tie: embed and unembed one parameter
    assert state.ties() == {"embed": ("unembed",)}, state.ties()
    state, model = C.unalias((state, model))                   # a donating jit refuses one buffer twice

    def step(model, state, x, y):
        loss, grads = jax.value_and_grad(wl.loss)(model, x, y)
        state, model = optim.update(state, model, grads)
        return model, state, loss

    c = JaxStep(name, wl, model, state, step)
    c.state_bytes = lambda: C.tree_bytes(c.opt.stacks)
    return c


def optax_tx(stack: bool):
    import optax

    adamw = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, PEAK, WARMUP, TOTAL, FINAL), weight_decay=WD)
    if not stack:
        return adamw
    return optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(MAX_NORM), adamw),
                                 max_consecutive_errors=10**9)


def make_optax(name, wl, stack: bool, head_copy: bool = False):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    tx = optax_tx(stack)
    params = wl.head_copy() if head_copy else wl.twin()
    loss_fn = wl.loss if head_copy else wl.twin_loss
    opt = tx.init(params)
    if stack:
        opt = (opt, jax.tree.map(C._copy, params), C._copy(np.zeros((), np.int32)))    # (state, EMA, step)

    def step(params, opt, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        if not stack:
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, loss
        st, ema, t = opt
        updates, st = tx.update(grads, st, params)
        params = optax.apply_updates(params, updates)
        decay = DECAY0 + (DECAY1 - DECAY0) * jnp.minimum(t, DECAY_STEPS) / DECAY_STEPS
        moved = optax.incremental_update(params, ema, 1 - decay)
        ema = jax.tree.map(lambda a, b: jnp.where(st.last_finite, a, b), moved, ema)
        return params, (st, ema, t + 1), loss

    return JaxStep(name, wl, params, opt, step)


class Torch(C.Candidate):
    """The model in torch, the same initial values; AdamW(fused=True) + clip + skip + EMA, eager."""

    def __init__(self, name, wl, threads: int):
        import numpy as np
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(threads)
        self.name, self._torch, self._F = name, torch, F
        self.cfg = wl.cfg
        init = wl.init
        t = (lambda a: torch.nn.Parameter(torch.from_numpy(np.array(a, copy=True))))
        vocab, d = init["embed"].shape
        self.emb = torch.nn.Embedding(vocab, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            self.emb.weight.copy_(torch.from_numpy(np.array(init["embed"], copy=True)))
        self.head.weight = self.emb.weight                     # the tie, as torch users write it
        self.pos = t(init["pos"])
        self.blocks = [{"ln1": (t(b["ln1"]["g"]), t(b["ln1"]["b"])), "qkv": t(b["attn"]["qkv"]),
                        "proj": t(b["attn"]["proj"]), "ln2": (t(b["ln2"]["g"]), t(b["ln2"]["b"])),
                        "w1": t(b["mlp"]["w1"]), "b1": t(b["mlp"]["b1"]), "w2": t(b["mlp"]["w2"]),
                        "b2": t(b["mlp"]["b2"])} for b in init["blocks"]]
        self.ln_f = (t(init["ln_f"]["g"]), t(init["ln_f"]["b"]))
        ps = [self.emb.weight, self.pos, *self.ln_f]
        for b in self.blocks:
            ps += [*b["ln1"], b["qkv"], b["proj"], *b["ln2"], b["w1"], b["b1"], b["w2"], b["b2"]]
        self.plist = ps
        self.opt = torch.optim.AdamW(ps, lr=lr_at(0), weight_decay=WD, fused=True)
        self.ema = [p.detach().clone() for p in ps]
        self._xs = [torch.from_numpy(np.array(x, np.int64)) for x in wl.xs]
        self._ys = [torch.from_numpy(np.array(y, np.int64)) for y in wl.ys]
        self.i, self.loss, self.skipped = 0, None, 0

    def forward(self, tokens):
        F, (B, T), d = self._F, tokens.shape, self.emb.weight.shape[1]
        h = self.cfg["heads"]
        x = self.emb(tokens) + self.pos[:T]
        for b in self.blocks:
            a = F.layer_norm(x, (d,), *b["ln1"], eps=1e-5) @ b["qkv"]
            q, k, v = (z.reshape(B, T, h, d // h).transpose(1, 2) for z in a.split(d, dim=-1))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + a.transpose(1, 2).reshape(B, T, d) @ b["proj"]
            m = F.gelu(F.layer_norm(x, (d,), *b["ln2"], eps=1e-5) @ b["w1"] + b["b1"], approximate="tanh")
            x = x + m @ b["w2"] + b["b2"]
        return self.head(F.layer_norm(x, (d,), *self.ln_f, eps=1e-5))

    def step(self):
        torch, k = self._torch, self.i % N_BATCHES
        self.opt.zero_grad(set_to_none=True)
        logits = self.forward(self._xs[k])
        loss = self._F.cross_entropy(logits.reshape(-1, logits.shape[-1]), self._ys[k].reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.plist, MAX_NORM)
        if torch.isfinite(norm):
            for g in self.opt.param_groups:
                g["lr"] = lr_at(self.i)
            self.opt.step()
            with torch.no_grad():
                torch._foreach_lerp_(self.ema, [p.detach() for p in self.plist], 1 - decay_at(self.i))
        else:
            self.skipped += 1
        self.loss = loss.detach()
        self.i += 1
        return self.loss

    def state_bytes(self):
        total = sum(e.numel() * e.element_size() for e in self.ema)
        for st in self.opt.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if hasattr(v, "element_size"))
        return total


def lr_at(t: int) -> float:
    """The learning rate at step t (0 at the first step), as optim.warmup_cosine and optax's schedule."""
    if t < WARMUP:
        return PEAK * t / WARMUP
    frac = min(t - WARMUP, TOTAL - WARMUP) / (TOTAL - WARMUP)
    return FINAL + (PEAK - FINAL) * 0.5 * (1 + math.cos(math.pi * frac))


def decay_at(t: int) -> float:
    return DECAY0 + (DECAY1 - DECAY0) * min(t, DECAY_STEPS) / DECAY_STEPS


def torch_threads() -> int:
    """As many threads as JAX's CPU client uses (one per core unless BENCH_TORCH_THREADS says otherwise)."""
    return int(os.environ.get("BENCH_TORCH_THREADS") or os.cpu_count() or 1)


def make(name: str, wl: Workload) -> C.Candidate:
    if name == "optim":
        return make_optim(name, wl, stack=True)
    if name == "optim AdamW":
        return make_optim(name, wl, stack=False)
    if name == "optax":
        return make_optax(name, wl, stack=True)
    if name == "optax head-copy":
        return make_optax(name, wl, stack=True, head_copy=True)
    if name == "optax adamw":
        return make_optax(name, wl, stack=False)
    if name == "torch":
        return Torch(name, wl, torch_threads())
    raise ValueError(f"unknown candidate {name!r}; choose from {ALL}")


# ------------------------------------------------------------------------------------------------ children
def child_first(args) -> dict:
    wl = workload(args.workload, args.quick)
    cand = make(args.candidate, wl)
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


def trajectory(c) -> list[float]:
    out = []
    for _ in range(CHECK_STEPS):
        out.append(c.step())
    return [float(v) for v in out]


def ema_diff(a, b, init) -> dict:
    """optim's `averaged(state, model)` against optax's EMA after the same steps, as their moves from the initial
    values: max |Δa - Δb| over all leaves / max |Δb| over all leaves (Δ = average - initial value)."""
    import jax
    import numpy as np
    import optim

    avg = dict(optim.averaged(a.opt, a.params))
    avg.pop("unembed")
    num = den = 0.0
    for x, y, x0 in zip(jax.tree.leaves(avg), jax.tree.leaves(b.opt[1]), jax.tree.leaves(init), strict=True):
        x, y, x0 = (np.asarray(v, np.float64) for v in (x, y, x0))
        num, den = max(num, float(np.abs(x - y).max())), max(den, float(np.abs(y - x0).max()))
    return {"a": a.name, "b": b.name, "max_rel": num / max(den, 1e-30), "max_move": den, "tol": TOL_EMA,
            "passed": bool(num <= TOL_EMA * den)}


def child_steps(args) -> dict:
    load0 = os.getloadavg()[0]
    wl = workload(args.workload, args.quick)
    cands, errors = {}, {}
    for n in args.candidates.split(","):
        try:
            cands[n] = make(n, wl)
        except Exception as e:
            errors[n] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    # The losses of the first CHECK_STEPS steps, from the same initial parameters on the same batches.
    t0 = time.perf_counter()
    losses = {}
    for n, c in list(cands.items()):
        try:
            losses[n] = trajectory(c)
            c.block()
        except Exception as e:
            errors[n] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            del cands[n]
    check_s = time.perf_counter() - t0
    ema = {}
    if "optim" in cands and REF in cands:
        ema = ema_diff(cands["optim"], cands[REF], wl.init)
    checks = []
    for a, b, tol in CHECKS + [("optax head-copy", REF, None)]:      # head-copy: other maths, shown only
        if a in losses and b in losses:
            rel = [abs(x - y) / abs(y) for x, y in zip(losses[a], losses[b])]
            checks.append({"a": a, "b": b, "tol": tol, "max_rel": max(rel), "rel": rel,
                           "passed": None if tol is None else bool(max(rel) <= tol)})
    gc.collect()
    res = interleave(cands, args.rounds, args.target)
    res["samples"].update(errors)
    res["state_bytes"] = {n: c.state_bytes() for n, c in cands.items()}
    if "torch" in sys.modules:
        res["torch_threads"] = sys.modules["torch"].get_num_threads()
    res.update(losses=losses, checks=checks, ema=ema, check_s=check_s, n_params=wl.n_params,
               unique_bytes=4 * wl.n_params, description=wl.description, loadavg=[load0, os.getloadavg()[0]])
    return res


# ------------------------------------------------------------------------------------------------ parent
def reduce(raw: dict) -> dict:
    samples = raw.get("samples", {})
    ref = samples.get(REF)
    ref = ref if isinstance(ref, list) and ref else None
    rows = {}
    for n, s in samples.items():
        if not isinstance(s, list):
            rows[n] = {"error": s}
            continue
        row = {"step_s": runner._median(s), "rounds": len(s)}
        if ref:
            r = [a / b for a, b in zip(s, ref)]
            row["vs_optax"], row["vs_optax_iqr"] = runner._median(r), runner._quartiles(r)
        bare = {"optim": "optim AdamW", "optax": "optax adamw"}.get(n)
        if bare and isinstance(samples.get(bare), list):
            row["vs_bare"] = runner._median([a / b for a, b in zip(s, samples[bare])])
        rows[n] = row
    return rows


def run_workload(name: str, cands: list[str], opts, log) -> dict:
    q = ["--quick"] if opts.quick else []
    sec = {"workload": name, "date": runner._now(), "optim": runner.optim_version(), "first": {},
           "rounds": opts.rounds, "target": opts.target, "candidates": cands}
    for c in cands:
        log(f"  {name}: first call: {c}")
        sec["first"][c] = runner._run_worker(["first", "--workload", name, "--candidate", c, *q], opts.timeout,
                                             log, module="bench.step")
    compile_s = sum(f.get("first_s", opts.timeout / 4) for f in sec["first"].values())
    budget = 120 + 3 * compile_s + len(cands) * opts.rounds * opts.target * 4
    log(f"  {name}: checks and step timing of {', '.join(cands)} ({opts.rounds} rounds, target {opts.target} s, "
        f"timeout {budget:.0f} s)")
    raw = runner._run_worker(["steps", "--workload", name, "--candidates", ",".join(cands),
                              "--rounds", str(opts.rounds), "--target", str(opts.target), *q], budget, log,
                             module="bench.step")
    sec["raw"] = raw
    end = runner.optim_version()
    if end != sec["optim"]:
        sec["optim"] += f" -> {end} (optim changed during the run)"
    if "samples" in raw:
        sec["rows"] = reduce(raw)
        for c in raw["checks"]:
            verdict = "info" if c["passed"] is None else ("ok" if c["passed"] else "FAILED")
            log(f"    losses {c['a']} vs {c['b']}: max rel diff {c['max_rel']:.1e} over {CHECK_STEPS} steps "
                f"({verdict})")
        e = raw.get("ema") or {}
        if e:
            log(f"    EMA optim vs optax after {CHECK_STEPS} steps: max rel diff {e['max_rel']:.1e} "
                f"({'ok' if e['passed'] else 'FAILED'})")
        log("    " + "; ".join(f"{n}: " + " ".join(f"{v:.6f}" for v in ls) for n, ls in raw["losses"].items()))
    return sec


# ------------------------------------------------------------------------------------------------ markdown
def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def _ms(s):
    return f"{1e3 * s:.3g}" if s < 1 else f"{1e3 * s:.0f}"


METHOD = f"""\
`python -m bench.step` (`bench/step.py`; raw results in `bench/STEP.json`). One training step of a real model:
forward, backward and optimiser in one jitted, donating step (params and optimiser state donated), the batches
cycling through {N_BATCHES} fixed device arrays. Method as above: one process per workload with all candidates
interleaved round by round (order rotating), a sample is `reps` back-to-back steps and one block; *vs optax* is
the median per-round ratio to `optax` (IQR in brackets; lower is faster); *vs bare* is the stack's per-round
ratio to the same library's bare AdamW (what clip + skip + EMA cost); first call (trace + compile + one step),
second call (a second compile shows here) and peak RSS from a separate process per candidate. float32; the
demo's optimiser settings: learning rate `warmup_cosine({PEAK:g}, {WARMUP}, {TOTAL}, final={FINAL:g})`, weight
decay {WD:g}, clipping at {MAX_NORM:g}, EMA decay `Linear({DECAY0:g}, {DECAY1:g}, {DECAY_STEPS})` (the same
schedules in each library).

Candidates: `optim` = `SkipNonFinite(EMA(chain(ClipGlobalNorm(1.0), AdamW(lr, weight_decay=0.1)),
decay=decay))` on the tied model, `optim.update` inside the user's `jax.jit(..., donate_argnums=(0, 1))`; `optax` =
`apply_if_finite(chain(clip_by_global_norm(1.0), adamw(lr, weight_decay=0.1)), max_consecutive_errors=10**9)`
and `ema = optax.incremental_update(params, ema, 1 - decay(t))` in the same step, kept where the step was skipped, on
the untied twin (no head position; the forward pass reads `embed` for the head: the same parameters and the same
maths as the tie); `optax head-copy` = the same optax step on a model whose head is its own parameter
initialised equal to the embedding (different maths: the copies drift apart, and the norm counts both); `torch`
= the same model in torch 2.13 eager (`head.weight = emb.weight`, `scaled_dot_product_attention`),
`AdamW(fused=True)`, `clip_grad_norm_(1.0)`, the step and `torch._foreach_lerp_` EMA only if the norm is
finite, `torch.set_num_threads` = the cores JAX uses; `optim AdamW` / `optax adamw` = the bare optimisers.
Before timing, each candidate runs {CHECK_STEPS} steps from the same initial values on the same batches and its
losses are compared with optax's."""


def section_md(sec: dict) -> list[str]:
    raw, rows, first = sec.get("raw", {}), sec.get("rows", {}), sec.get("first", {})
    out = [f"### {sec['workload']}", ""]
    when = f"measured {sec['date']} (optim {sec.get('optim', '?')}), {sec.get('rounds')} rounds"
    if raw.get("loadavg"):
        when += f", load average {raw['loadavg'][0]:.1f} -> {raw['loadavg'][1]:.1f}"
    if raw.get("torch_threads"):
        when += f", torch threads {raw['torch_threads']}"
    out += [f"{raw.get('description', '')}; {when}.", ""]
    if not rows:
        return out + [f"No step results: {raw.get('error') or raw.get('timeout') or raw}", ""]
    out += ["| candidate | step (ms) | vs optax | vs bare | first call (s) | first call vs optax | second call (s) "
            "| peak RSS (MB) | RSS vs optax | state |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ref_f = first.get(REF, {})
    ub = raw.get("unique_bytes")
    for n in sec.get("candidates", list(rows)):
        r, f = rows.get(n, {}), first.get(n) or {}
        if "error" in r:
            out.append(f"| {n} | {r['error'][:120].replace('|', '/')} | | | | | | | | |")
            continue
        vs = _f(r.get("vs_optax"))
        iqr = r.get("vs_optax_iqr") or (None, None)
        if n != REF and iqr[0] is not None:
            vs += f" ({iqr[0]:.2f}–{iqr[1]:.2f})"
        fc = f"{f['first_s']:.2f}" if "first_s" in f else ("error" if f else "–")
        fvs = _f(f["first_s"] / ref_f["first_s"]) if "first_s" in f and "first_s" in ref_f else "–"
        sc = _f(f.get("second_s"))
        rss = _f(f.get("peak_rss_mb"), "{:.0f}")
        rvs = _f(f["peak_rss_mb"] / ref_f["peak_rss_mb"]) if "peak_rss_mb" in f and "peak_rss_mb" in ref_f else "–"
        sb = raw.get("state_bytes", {}).get(n)
        state = "–" if sb is None or not ub else f"{sb / ub:.2f}x"
        out.append(f"| {n} | {_ms(r['step_s']) if 'step_s' in r else '–'} | {vs} | {_f(r.get('vs_bare'))} | {fc} "
                   f"| {fvs} | {sc} | {rss} | {rvs} | {state} |")
    checks = raw.get("checks", [])
    if checks:
        out += ["", f"Loss trajectory, {CHECK_STEPS} steps from the same initial values (largest relative "
                "difference of the step's loss from the reference's): " + "; ".join(
                    f"`{c['a']}` vs `{c['b']}` {c['max_rel']:.1e} ("
                    + ("not the same maths, not checked" if c["tol"] is None else
                       f"tol {c['tol']:g}, {'ok' if c['passed'] else '**FAILED**'}") + ")" for c in checks) + "."]
        e = raw.get("ema") or {}
        if e:
            out[-1] += (f" Parameter averages after those steps, `optim.averaged(state, model)` vs optax's EMA: "
                        f"{e['max_rel']:.1e} of the largest move (tol {e['tol']:g}, "
                        f"{'ok' if e['passed'] else '**FAILED**'}).")
        ls = raw.get("losses", {})
        if REF in ls:
            out += [f"`optax` losses: {', '.join(f'{v:.6f}' for v in ls[REF])}."]
    return out + [""]


def render(data: dict) -> list[str]:
    """The RESULTS.md section (a list of lines; [] when nothing was measured)."""
    secs = data.get("sections", {})
    if not secs:
        return []
    out = [TITLE, "", METHOD, ""]
    if data.get("note"):                 # hand-written, about these measurements (dropped by the next run)
        out += [data["note"], ""]
    ok = [w for w in WORKLOADS if w in secs and secs[w].get("rows", {}).get(REF, {}).get("step_s")]
    if ok:
        out += ["Summary, step time relative to optax (median per-round ratio; optax's step in ms): "
                + "; ".join(f"{w}: optim {_f(secs[w]['rows'].get('optim', {}).get('vs_optax'))}, torch "
                            f"{_f(secs[w]['rows'].get('torch', {}).get('vs_optax'))}, optax "
                            f"{_ms(secs[w]['rows'][REF]['step_s'])} ms" for w in ok) + ".", ""]
    for w in WORKLOADS:
        if w in secs:
            out += section_md(secs[w])
    return out


def saved_section() -> list[str]:
    """The section from bench/STEP.json (used by `bench.report.render`, so `python -m bench` keeps it)."""
    return render(runner.load(JSON_PATH))


def splice(results_md: Path, lines: list[str]) -> None:
    """Put the section into RESULTS.md: in place of an earlier one, else before the hand-written analysis (or at
    the end); every other section is left as it is."""
    text = results_md.read_text() if results_md.exists() else "# optim benchmarks\n"
    block = "\n".join(lines).rstrip() + "\n\n"
    pat = re.compile(rf"^{re.escape(TITLE)}\n.*?(?=^## |\Z)", re.M | re.S)
    if pat.search(text):
        text = pat.sub(lambda _: block, text, count=1)
    else:
        m = re.search(r"^## Analysis", text, re.M)
        text = text[:m.start()] + block + text[m.start():] if m else text.rstrip() + "\n\n" + block
    results_md.write_text(text.rstrip() + "\n")


# ------------------------------------------------------------------------------------------------ main
def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", choices=["first", "steps"], help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 round (~1 minute; numbers meaningless)")
    ap.add_argument("--only", default=None, help=f"comma-separated workloads: {', '.join(WORKLOADS)} (default all)")
    ap.add_argument("--candidates", default=None, help=f"comma-separated candidates (default all): {', '.join(ALL)}"
                                                       "; optax is always added")
    ap.add_argument("--no-torch", action="store_true", help="leave torch out (it is left out when not installed)")
    ap.add_argument("--torch-threads", type=int, default=None, help="torch threads (default: the cores, as JAX)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per workload (default 9; quick 1)")
    ap.add_argument("--target", type=float, default=None, help="seconds per timed sample (default 0.6; quick 0)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per first-call process (default 300)")
    ap.add_argument("--out", default=None, help="RESULTS.md to put the section into (default bench/RESULTS.md; "
                                                "quick: none unless given); the raw results go to STEP.json "
                                                "next to it")
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--candidate", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.rounds = a.rounds or (1 if a.quick else 9)
    a.target = a.target if a.target is not None else (0.0 if a.quick else 0.6)
    a.timeout = a.timeout or 300.0
    if a.out is None and not a.quick and a.mode is None:
        a.out = str(HERE / "RESULTS.md")
    return a


def main(argv=None) -> int:
    opts = parse(argv)
    if opts.mode:
        res = child_first(opts) if opts.mode == "first" else child_steps(opts)
        sys.stdout.write(MARK + json.dumps(res) + "\n")
        sys.stdout.flush()
        return 0
    if opts.torch_threads:
        os.environ["BENCH_TORCH_THREADS"] = str(opts.torch_threads)
    t_start = time.perf_counter()
    log = (lambda m: print(f"[{time.perf_counter() - t_start:6.1f} s] {m}", flush=True))
    names = ([n for n in WORKLOADS if n not in ON_REQUEST] if opts.only is None
             else [s.strip() for s in opts.only.split(",") if s.strip()])
    bad = [n for n in names if n not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown workloads {bad}; choose from {list(WORKLOADS)}")
    cands = ALL if opts.candidates is None else [c.strip() for c in opts.candidates.split(",")]
    if REF not in cands:
        cands = [REF, *cands]
    if opts.no_torch or not C.torch_available():
        if "torch" in cands and not opts.no_torch:
            log("torch is not importable: its candidate is left out (pip install torch==2.13.0)")
        cands = [c for c in cands if c != "torch"]
    sections = {}
    for n in names:
        log(n)
        sections[n] = run_workload(n, cands, opts, log)
    out = Path(opts.out) if opts.out else None
    json_path = out.with_name("STEP.json") if out else None
    data = (runner.load(json_path) if json_path else {}) or {"sections": {}}
    data["sections"].update(sections)
    data.pop("note", None)
    data["machine"] = runner.machine_info()
    data["date"] = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    data["command"] = " ".join(["python -m bench.step", *(argv if argv is not None else sys.argv[1:])])
    md = render(data)
    if out is None:
        print("\n".join(md))
    else:
        runner.save(json_path, data)
        splice(out, md)
        log(f"wrote {json_path} and the section '{TITLE[3:]}' of {out}")
    failed = [f"{s}: {c['a']} vs {c['b']}" for s, sec in sections.items()
              for c in sec.get("raw", {}).get("checks", []) + [sec.get("raw", {}).get("ema") or {}]
              if c.get("passed") is False]
    missing = [s for s, sec in sections.items() if "rows" not in sec]
    if missing:
        log(f"workloads without results: {missing}")
    if failed:
        log(f"loss trajectories DIFFER: {failed}")
    log(f"total {time.perf_counter() - t_start:.1f} s")
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
