"""Data-parallel training of a tied model with optim, on 8 simulated CPU devices: `pmap` and sharded `jit`.

    python examples/data_parallel.py               # ~20 s on 2 CPU cores
    python examples/data_parallel.py --devices 4 --steps 50

The model is a small character-level MLP whose input embedding and output projection are one array
(`params["embed"] is params["unembed"]`). `optim.setup` runs once, outside any transformation, and records the
tie in the state's static layout; `optim.update` then runs inside

1. `jax.pmap`: per-device gradients are averaged with `lax.pmean`, and every device applies the same update to
   its replica of the parameters and the optimiser state;
2. `jax.jit` with a `NamedSharding`: the batch is split over a 1-D device mesh, parameters and optimiser state
   are replicated, and XLA inserts the all-reduce itself.

Both give the same parameters as a single-device run on the whole batch (up to float rounding), and the tie holds
on every device. The devices are simulated (`--xla_force_host_platform_device_count`, set before jax is imported),
so this shows correctness, not speed.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--steps", type=int, default=200, help="training steps per method (default 200)")
    p.add_argument("--batch", type=int, default=512, help="global batch, split over the devices (default 512)")
    p.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "data" / "shakespeare.txt")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
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

CONTEXT = 4   # predict a character from the 4 before it


def init_params(key, vocab: int, d: int = 32, hidden: int = 256) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    E = 0.1 * jax.random.normal(k1, (vocab, d))
    return {
        "embed": E,
        "mlp": {"w1": jax.random.normal(k2, (CONTEXT * d, hidden)) / np.sqrt(CONTEXT * d), "b1": jnp.zeros(hidden),
                "w2": jax.random.normal(k3, (hidden, d)) / np.sqrt(hidden), "b2": jnp.zeros(d)},
        "unembed": E,                  # the same array object: one parameter in two places
    }


def loss_fn(params, x, y):
    h = params["embed"][x].reshape(x.shape[0], -1)
    h = jnp.tanh(h @ params["mlp"]["w1"] + params["mlp"]["b1"]) @ params["mlp"]["w2"] + params["mlp"]["b2"]
    logits = h @ params["unembed"].T
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1).mean()


def make_batches(path: Path, batch: int, steps: int, seed: int = 0):
    text = path.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    ids = np.array([vocab.index(c) for c in text[:200_000]], np.int32)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        i = rng.integers(0, len(ids) - CONTEXT, batch)
        out.append((ids[i[:, None] + np.arange(CONTEXT)], ids[i + CONTEXT]))
    return out, len(vocab)


def main(args):
    n = jax.device_count()
    if n != args.devices:
        raise SystemExit(f"expected {args.devices} devices, jax sees {n} (was jax imported before XLA_FLAGS?)")
    if args.batch % n:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --devices {n}")
    data, vocab = make_batches(args.data, args.batch, args.steps)
    params = init_params(jax.random.key(0), vocab)
    warmup = max(1, min(20, args.steps // 5))   # warmup_cosine needs decay_steps > warmup_steps
    schedule = optim.warmup_cosine(1e-2, warmup, max(args.steps, warmup + 1))
    rule = optim.OptimiserChain(optim.ClipGlobalNorm(1.0), optim.AdamW(schedule, weight_decay=1e-4))
    state = optim.setup(rule, params)
    print(f"{n} devices: {jax.devices()[0].platform} x {n};  ties: {state.ties()}")

    def step(state, params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        state, params = optim.update(state, params, grads)
        return state, params, loss

    results = {}

    # 0. Reference: one device, the whole batch.
    t = time.perf_counter()
    one = jax.jit(step)
    s, p = state, params
    for x, y in data:
        s, p, loss = one(s, p, x, y)
    results["single device"] = (p, float(loss), time.perf_counter() - t)

    # 1. pmap: replicate parameters and state along a leading device axis, split the batch, average the grads.
    def pmap_step(state, params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads, loss = jax.lax.pmean((grads, loss), axis_name="devices")   # all-reduce
        state, params = optim.update(state, params, grads)
        return state, params, loss

    t = time.perf_counter()
    replicate = lambda tree: jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (n, *np.shape(a))), tree)
    s, p = replicate(state), replicate(params)   # the State is a pytree: its static layout (ties) is kept
    pstep = jax.pmap(pmap_step, axis_name="devices")
    for x, y in data:
        s, p, loss = pstep(s, p, x.reshape(n, -1, CONTEXT), y.reshape(n, -1))
    for leaf in jax.tree.leaves(p):              # every device holds the same replica
        np.testing.assert_array_equal(np.asarray(leaf)[0], np.asarray(leaf)[-1])
    np.testing.assert_array_equal(np.asarray(p["embed"]), np.asarray(p["unembed"]))   # tied on every device
    results["pmap"] = (jax.tree.map(lambda a: np.asarray(a)[0], p), float(loss[0]), time.perf_counter() - t)

    # 2. Sharded jit: a 1-D mesh; the batch is split along it, everything else replicated.
    t = time.perf_counter()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))   # jit places the all-reduce
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    s, p = jax.device_put((state, params), replicated)
    sstep = jax.jit(step, out_shardings=replicated)
    for x, y in data:
        s, p, loss = sstep(s, p, *jax.device_put((x, y), rows))
    print(f"sharded jit: batch {jax.device_put(data[0][0], rows).sharding.spec}, "
          f"embed {p['embed'].sharding.spec} on {len(p['embed'].sharding.device_set)} devices")
    np.testing.assert_array_equal(np.asarray(p["embed"]), np.asarray(p["unembed"]))
    results["sharded jit"] = (p, float(loss), time.perf_counter() - t)

    ref = results["single device"][0]
    for name, (p, loss, secs) in results.items():
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref)))
        print(f"{name:>14}: final loss {loss:.4f}   max |param - single device| {diff:.1e}   {secs:5.1f} s")
        assert diff < 1e-3, f"{name} drifted from the single-device run by {diff}"
    assert len(state.ties()) == 1
    print("the tie held everywhere: embed == unembed, one optimiser state for both")
    return results


if __name__ == "__main__":
    main(ARGS)
