"""`python -m bench.microbatch_memory`: compiled temp memory and step time of `optim.microbatch` vs full batch.

An MLP classifier (float32, activations >> parameters) on one large batch. For the full-batch
`jax.value_and_grad` and for `optim.microbatch(value_and_grad, n)`, n in 1, 2, 4, 8, 16, both under `jax.jit`:

- temp memory: `jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes`, XLA's buffer for
  intermediates (activations, the scan's running sums); arguments and outputs are the same for every variant;
- total memory: arguments + outputs + temp - aliased, from the same analysis (the program's planned
  footprint; XLA:CPU's own `peak_memory_in_bytes` leaves temp out, so it is not used);
- step time: the median of `--reps` timed calls after one warm-up call (`block_until_ready`).

Prints a markdown table to stdout. Standalone: nothing is written and the other bench files are not used.
Defaults run in well under a minute on 2 CPU cores; `--batch`, `--hidden`, `--reps` change the sizes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import optim

NS = (1, 2, 4, 8, 16)


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.microbatch_memory", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4096, help="batch size (divisible by 16), default 4096")
    ap.add_argument("--d-in", type=int, default=128, help="input features, default 128")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden width (2 hidden layers), default 1024")
    ap.add_argument("--classes", type=int, default=16, help="output classes, default 16")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per variant (median), default 5")
    return ap.parse_args(argv)


def build(a):
    k = np.random.default_rng(0)

    def dense(i, o):
        return {"w": jnp.asarray(k.normal(size=(i, o)) / np.sqrt(i), jnp.float32), "b": jnp.zeros(o, jnp.float32)}

    params = [dense(a.d_in, a.hidden), dense(a.hidden, a.hidden), dense(a.hidden, a.classes)]
    x = jnp.asarray(k.normal(size=(a.batch, a.d_in)), jnp.float32)
    y = jnp.asarray(k.integers(0, a.classes, size=a.batch), jnp.int32)

    def loss(p, x, y):
        h = x
        for layer in p[:-1]:
            h = jax.nn.gelu(h @ layer["w"] + layer["b"])
        logits = h @ p[-1]["w"] + p[-1]["b"]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0])

    return params, x, y, loss


def measure(f, args, reps):
    jitted = jax.jit(f)
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp = mem.temp_size_in_bytes
    peak = temp + mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return temp, peak, statistics.median(times), compile_s, compiled(*args)


def main(argv=None):
    a = parse(argv)
    if a.batch % max(NS):
        raise SystemExit(f"--batch {a.batch} must be divisible by {max(NS)}")
    params, x, y, loss = build(a)
    n_params = sum(v.size for v in jax.tree.leaves(params))
    full = jax.value_and_grad(loss)
    args = (params, x, y)

    rows = []
    t_full, p_full, s_full, c_full, (l_full, _) = measure(full, args, a.reps)
    rows.append(("full batch `jax.value_and_grad`", "–", a.batch, t_full, p_full, s_full, c_full, 0.0))
    for n in NS:
        temp, peak, step, comp, (l, _) = measure(optim.microbatch(full, n), args, a.reps)
        rows.append((f"`optim.microbatch(vg, {n})`", str(n), a.batch // n, temp, peak, step, comp,
                     abs(float(l) - float(l_full)) / abs(float(l_full))))

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"MLP {a.d_in}-{a.hidden}-{a.hidden}-{a.classes} (gelu, softmax cross-entropy), float32, "
          f"{n_params / 1e6:.2f}M parameters ({4 * n_params / 2**20:.1f} MiB), batch {a.batch}; "
          f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores, load {load:.1f}); "
          f"step = median of {a.reps} calls after a warm-up.\n")
    print("| variant | n | slice | temp MiB | temp / full | total MiB | total / full | step ms | step / full "
          "| compile s | loss rel. diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, n, sl, temp, peak, step, comp, diff in rows:
        print(f"| {name} | {n} | {sl} | {temp / 2**20:.1f} | {temp / t_full:.2f} | {peak / 2**20:.1f} | "
              f"{peak / p_full:.2f} | {1e3 * step:.1f} | {step / s_full:.2f} | {comp:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
