"""Train a small character-level transformer whose input embedding and output projection are ONE array.

    python examples/train_tied_lm.py                      # ~4 minutes on 2 CPU cores (`make demo`)
    python examples/train_tied_lm.py --steps 20 --size tiny
    python examples/train_tied_lm.py --devices 4          # data parallel on 4 simulated CPU devices
    python examples/train_tied_lm.py --resume --steps 1200  # continue the last run to step 1200

The model is a plain dict of jax arrays with the same array object at two places:

    params = {"embed": E, "pos": ..., "blocks": [...], "ln_f": ..., "unembed": E}

`jax.grad` returns two gradients for E (one per place). optax would treat them as two parameters with two
Adam states, and the two copies would drift apart after the first step. `optim.setup` sees that both places hold
the same object, records one parameter with two positions in its (static) tie map, and every `optim.update`, here
inside a `jax.jit` train step, sums the two gradients, runs AdamW once and writes the same new array to both
places. The script checks at the end that the tie held.

Optimiser: `OptimiserChain(ClipGlobalNorm(1.0), AdamW(warmup_cosine(...), weight_decay=0.1))`; the global norm
counts E once. Data: `examples/data/shakespeare.txt` (public domain; see examples/data/README.md).
Outputs in --out (default runs/tied_lm): loss.png (loss curve), checkpoint.npz (`optim.save` of the state and
the model: tie map, hyperparameters, step counter, every array, the tied embedding once) and checkpoint.json
(the loss histories).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

SIZES = {
    #          width, layers, heads, context, batch
    "tiny":  dict(d=32, layers=2, heads=2, ctx=32, batch=8),
    "small": dict(d=128, layers=2, heads=4, ctx=128, batch=32),
    "base":  dict(d=256, layers=2, heads=8, ctx=256, batch=32),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="total training steps (default 600)")
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model size (default small)")
    p.add_argument("--data", type=Path, default=HERE / "data" / "shakespeare.txt", help="a text file")
    p.add_argument("--devices", type=int, default=1,
                   help="data-parallel over N simulated CPU devices (sets XLA_FLAGS before importing jax)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.npz up to --steps")
    p.add_argument("--out", type=Path, default=Path("runs/tied_lm"), help="where loss.png and the checkpoint go")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: from --size)")
    p.add_argument("--sample", type=int, default=400, help="characters to generate at the end (default 400)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.devices > 1:
    # Must happen before jax is imported: XLA reads it once, when the CPU backend starts.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices}").strip()
    # XLA's CPU client runs every simulated device's program on one thread pool, by default one thread per core.
    # A device waiting in an all-reduce holds a thread, and the next step's programs queue behind it, so with
    # few cores the devices still computing can starve and the all-reduce deadlocks (jaxlib 0.10 on 2 cores:
    # within a few hundred steps). Several threads per device avoid it; idle threads cost nothing.
    os.environ.setdefault("PJRT_NPROC", str(max(4 * ARGS.devices, os.cpu_count() or 1)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import optim  # noqa: E402


# ------------------------------------------------------------------------------------------------- model
def init_params(key, vocab: int, d: int, layers: int, ctx: int, **_) -> dict:
    """A GPT-style pre-LayerNorm transformer as a plain dict. `embed` and `unembed` are the same array."""
    keys = iter(jax.random.split(key, 2 + 4 * layers))

    def normal(shape, std=0.02):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    def norm():
        return {"g": jnp.ones(d), "b": jnp.zeros(d)}

    out_std = 0.02 / math.sqrt(2 * layers)
    E = normal((vocab, d))
    return {
        "embed": E,
        "pos": normal((ctx, d), 0.01),
        "blocks": [{"ln1": norm(),
                    "attn": {"qkv": normal((d, 3 * d)), "proj": normal((d, d), out_std)},
                    "ln2": norm(),
                    "mlp": {"w1": normal((d, 4 * d)), "b1": jnp.zeros(4 * d),
                            "w2": normal((4 * d, d), out_std), "b2": jnp.zeros(d)}}
                   for _ in range(layers)],
        "ln_f": norm(),
        "unembed": E,                      # the same object: one parameter in two places
    }


def layer_norm(p, x):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]


def attention(p, x, heads: int):
    B, T, D = x.shape
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(B, T, heads, D // heads) for a in (q, k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D // heads)
    causal = jnp.tril(jnp.ones((T, T), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", weights, v).reshape(B, T, D) @ p["proj"]


def forward(params, tokens, heads: int):
    """Logits `(batch, time, vocab)` for integer `tokens` `(batch, time)`."""
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    for blk in params["blocks"]:
        x = x + attention(blk["attn"], layer_norm(blk["ln1"], x), heads)
        h = jax.nn.gelu(layer_norm(blk["ln2"], x) @ blk["mlp"]["w1"] + blk["mlp"]["b1"])
        x = x + h @ blk["mlp"]["w2"] + blk["mlp"]["b2"]
    return layer_norm(params["ln_f"], x) @ params["unembed"].T     # output projection: the tied array


def loss_fn(params, x, y, heads: int):
    logits = forward(params, x, heads)
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()


# -------------------------------------------------------------------------------------------------- data
def load_text(path: Path) -> tuple[np.ndarray, str]:
    text = path.read_text(encoding="utf-8")
    vocab = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = np.fromiter((lookup[c] for c in text), dtype=np.int32, count=len(text))
    return ids, vocab


def batches(ids: np.ndarray, batch: int, ctx: int, rng: np.random.Generator):
    """Random windows of `ctx + 1` characters: inputs and next-character targets."""
    starts = np.arange(ctx + 1)
    while True:
        i = rng.integers(0, len(ids) - ctx - 1, size=batch)[:, None] + starts
        w = ids[i]
        yield w[:, :-1], w[:, 1:]


# ------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, params, state, losses, val, meta: dict) -> None:
    """`optim.save` of the state and the model (the tie map, hyperparameters, step counter and every array; the
    tied embedding stored once), plus a JSON file beside it with the loss histories; both written atomically."""
    optim.save(path, state, params)
    side = path.with_suffix(".json")
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "losses": [float(v) for v in losses], "val": [list(r) for r in val]}))
    os.replace(tmp, side)


def load_checkpoint(path: Path, params, state):
    """Inverse of `save_checkpoint`, onto a freshly built model and state: `optim.load` checks the structure,
    shapes and rule, and re-links the tie (embed and unembed come back as one array)."""
    try:
        state, params = optim.load(path, like=(state, params))
    except ValueError as e:
        raise SystemExit(f"{path}: {e}") from None
    side = json.loads(path.with_suffix(".json").read_text())
    return params, state, side["losses"], [tuple(r) for r in side["val"]], side["meta"]


# ---------------------------------------------------------------------------------------------- sampling
def make_sampler(heads: int, ctx: int, n: int, temperature: float = 0.8):
    @jax.jit
    def sample(params, window, key):
        def one(carry, key):
            window = carry
            logits = forward(params, window[None], heads)[0, -1] / temperature
            c = jax.random.categorical(key, logits)
            return jnp.concatenate([window[1:], c[None]]), c
        _, out = jax.lax.scan(one, window, jax.random.split(key, n))
        return out
    return sample


# -------------------------------------------------------------------------------------------------- main
def main(args) -> dict:
    from tqdm import tqdm

    cfg = dict(SIZES[args.size])
    if args.batch:
        cfg["batch"] = args.batch
    n_dev = jax.device_count()
    if args.devices > 1 and n_dev < args.devices:
        raise SystemExit(f"--devices {args.devices}: jax sees only {n_dev} devices (was jax imported before "
                         "XLA_FLAGS was set?)")
    n_dev = max(args.devices, 1)
    if cfg["batch"] % n_dev:
        cfg["batch"] += n_dev - cfg["batch"] % n_dev        # every device gets the same number of rows

    ids, vocab = load_text(args.data)
    if len(ids) < 4 * (cfg["ctx"] + 1):
        raise SystemExit(f"{args.data}: {len(ids)} characters is too short for a context of {cfg['ctx']}")
    split = int(0.95 * len(ids))
    train_ids, val_ids = ids[:split], ids[split:]
    heads, ctx, batch = cfg["heads"], cfg["ctx"], cfg["batch"]

    params = init_params(jax.random.key(args.seed), len(vocab), **cfg)
    assert params["embed"] is params["unembed"]

    warmup = max(1, min(100, args.steps // 10))
    schedule = optim.warmup_cosine(args.lr, warmup, max(args.steps, warmup + 1), final=args.lr / 10)
    rule = optim.OptimiserChain(optim.ClipGlobalNorm(1.0), optim.AdamW(schedule, weight_decay=0.1))
    # Also keep a moving average of the parameters to evaluate with; its decay is a schedule too, rising as
    # training settles (a fixed 0.99 would hold on to the random initialisation for the first hundreds of steps).
    rule = optim.EMA(rule, decay=optim.Linear(0.5, 0.99, max(1, args.steps // 2)))
    state = optim.setup(rule, params)        # finds the tie: {'embed': ('unembed',)}
    n_params = sum(a.size for a in optim.trainables(params))         # the tied array counts once
    n_positions = sum(a.size for a in jax.tree.leaves(params))

    ckpt = args.out / "checkpoint.npz"
    losses: list[float] = []
    val: list[tuple[int, float]] = []               # (step, validation loss)
    if args.resume:
        if not ckpt.exists():
            raise SystemExit(f"--resume: no checkpoint at {ckpt}")
        params, state, losses, val, meta = load_checkpoint(ckpt, params, state)
        if meta["vocab"] != vocab or meta["size"] != args.size:
            raise SystemExit(f"--resume: {ckpt} was trained with size {meta['size']!r} on another text")
        state = optim.adjust(state, lr=schedule)     # the schedule for the (possibly longer) new run
        print(f"resumed from {ckpt} at step {int(state.step)}")

    # One device: plain jit. Several: the batch is split over a 1-D mesh and everything else is replicated;
    # jit inserts the gradient all-reduce, and optim.update runs inside the same program on every device.
    mesh = jax.make_mesh((n_dev,), ("data",), axis_types=(AxisType.Auto,)) if n_dev > 1 else None
    if mesh is not None:
        replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        params, state = jax.device_put((params, state), replicated)

    def step_fn(state, params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, heads)
        # Norms from the same compiled step, the tied embedding counted once; only the global ones are returned
        # (per-parameter norms are in stats["per_param"], keyed by path).
        state, params, stats = optim.update(state, params, grads, return_stats=True)
        return state, params, (loss, stats["grad_norm"], stats["update_norm"])

    train_step = jax.jit(step_fn) if mesh is None else jax.jit(step_fn, out_shardings=replicated)
    eval_loss = jax.jit(lambda p, x, y: loss_fn(p, x, y, heads))

    val_rng = np.random.default_rng(1234)
    val_batches = [next(batches(val_ids, batch, ctx, val_rng)) for _ in range(4)]

    def val_loss(params):
        return float(np.mean([eval_loss(params, x, y) for x, y in val_batches]))

    print(f"data: {args.data.name}, {len(ids):,} characters, vocabulary {len(vocab)}")
    print(f"model: {args.size} {cfg}, {n_params:,} parameters ({n_positions:,} if the tie were counted twice)")
    print(f"optimiser: {rule!r}")
    print(f"ties: {state.ties()}   devices: {n_dev}")

    start = int(state.step)
    val_start = val_loss(params)
    if not val or val[-1][0] != start:
        val.append((start, val_start))
    val_every = max(1, (args.steps - start) // 12)
    rng = np.random.default_rng(args.seed + start)
    data = batches(train_ids, batch, ctx, rng)
    tokens_per_step = batch * ctx
    t0 = time.perf_counter()
    t_steady, steady_steps = None, 0
    pending: list = []
    norms: list[tuple[float, float]] = []            # (gradient norm, update norm) per step
    bar = tqdm(range(start, args.steps), initial=0, total=max(args.steps - start, 0), unit="step",
               dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
    for i in bar:
        x, y = next(data)
        if mesh is not None:
            x, y = jax.device_put((x, y), rows)
        state, params, logged = train_step(state, params, x, y)
        pending.append(logged)
        if (i + 1 - start) % val_every == 0 and i + 1 < args.steps:
            val.append((i + 1, val_loss(params)))
        if len(pending) == 10 or i == args.steps - 1:
            losses.extend(float(v[0]) for v in pending)       # one device sync per 10 steps
            norms.extend((float(v[1]), float(v[2])) for v in pending)
            pending = []
            now = time.perf_counter()
            if t_steady is None:                              # exclude the first (compiling) steps
                t_steady, steady_steps = now, i + 1 - start
            rate = (i + 1 - start - steady_steps) * tokens_per_step / max(now - t_steady, 1e-9)
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}", grad_norm=f"{norms[-1][0]:.2f}",
                            tok_s=f"{rate:,.0f}" if rate else "...", refresh=False)
    bar.close()
    jax.block_until_ready(params)
    wall = time.perf_counter() - t0
    done = args.steps - start
    timed = done - steady_steps
    tok_s = timed * tokens_per_step / (time.perf_counter() - t_steady) if t_steady and timed > 0 else float("nan")
    val_end = val_loss(params)
    val_ema = val_loss(optim.averaged(state, params))   # the moving average of the parameters, tie kept
    if val[-1][0] != args.steps:
        val.append((max(args.steps, start), val_end))

    # The tie held: both places hold the same values, and the optimiser state has one parameter for them.
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(params["unembed"]))
    assert len(state.ties()) >= 1 and state.ties()["embed"] == ("unembed",), state.ties()
    # jit returns a separate buffer per output, so the two places now hold equal but distinct arrays (the state's
    # tie map is what kept them tied). Make them one object again for anything that finds ties by identity.
    params = optim.retie(state, params)
    assert params["embed"] is params["unembed"]

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"size": args.size, "vocab": vocab, "steps": int(state.step), "data": str(args.data.name)}
    save_checkpoint(ckpt, params, state, losses, val, meta)
    png = args.out / "loss.png"
    lrs = np.asarray(jax.vmap(schedule)(jnp.arange(len(losses))))
    plot(losses, val, lrs, png, start, title=f"{args.size} tied char transformer on {args.data.name}")

    first = float(np.mean(losses[:10])) if losses else float("nan")
    last = float(np.mean(losses[-10:])) if losses else float("nan")
    prompt = "\n\n"
    window = np.full(ctx, vocab.index("\n") if "\n" in vocab else 0, np.int32)
    sampler = make_sampler(heads, ctx, args.sample)
    text = "".join(vocab[c] for c in np.asarray(sampler(params, jnp.asarray(window), jax.random.key(args.seed))))

    print(f"\nsteps {start} -> {int(state.step)} in {wall:.1f} s "
          f"({tok_s:,.0f} tokens/s after compilation, {n_dev} device{'s' * (n_dev > 1)})")
    print(f"train loss (10-step means over the whole run): first {first:.3f}  last {last:.3f}")
    print(f"val loss: {val_start:.3f} -> {val_end:.3f}   (uniform guess: {math.log(len(vocab)):.3f});  "
          f"with the EMA of the parameters: {val_ema:.3f}")
    if norms:
        print(f"gradient norm (each parameter once, the tie's gradients summed): first {norms[0][0]:.3f}  "
              f"last {norms[-1][0]:.3f};  update norm: first {norms[0][1]:.2e}  last {norms[-1][1]:.2e}")
    print(f"tie held: embed == unembed, optim state ties {state.ties()}")
    print(f"loss curve: {png}")
    print(f"checkpoint: {ckpt} (optim.save: state, tie map and model, the tied embedding once)")
    print(f"--- sample ({args.sample} characters, temperature 0.8) ---{prompt}{text}\n---")
    return {"first": first, "last": last, "val_start": val_start, "val_end": val_end, "val_ema": val_ema,
            "tok_s": tok_s, "wall": wall, "grad_norm_last": norms[-1][0] if norms else float("nan")}


def plot(losses, val, lrs, path: Path, resumed_at: int, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8, label="train loss (per step)")
    if len(losses) >= 20:
        k = max(5, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, color="tab:blue", lw=2, label=f"train loss ({k}-step mean)")
    if val:
        ax.plot(*np.asarray(val).T, "o-", color="tab:orange", ms=4, label="validation loss")
    if resumed_at:
        ax.axvline(resumed_at, color="grey", ls=":", lw=1, label="resumed")
    ax.set(xlabel="step", ylabel="cross-entropy (nats / character)", title=title)
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, lrs, color="grey", lw=1, alpha=0.6, label="learning rate (right axis)")
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_ylim(0, max(lrs, default=1) * 1.1)
    lines = ax.get_legend_handles_labels()
    more = lr_ax.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1])
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main(ARGS)
