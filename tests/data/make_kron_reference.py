"""Writes `tests/data/kron_reference.npz`: psgd-jax's `kron` in float64 on the problem of `tests/kron_problem.py`,
each parameter in a model of its own (so that its random numbers are the ones optim draws with `seed=5318008`),
the parameters after every step.

Run it in a virtual environment of its own (psgd-jax needs an optax older than optim's; flax, which it imports
only for `flax.linen.Partitioned`, is replaced by a stand-in below):

    python3 -m venv /tmp/refenv && /tmp/refenv/bin/pip install psgd-jax==0.2.9 optax==0.2.4 chex
    /tmp/refenv/bin/python tests/data/make_kron_reference.py [tests/data/kron_reference.npz]

The stored fixture was made with psgd-jax 0.2.9, optax 0.2.4 and jax 0.10.2, with x64 enabled.
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kron_problem import CONFIGS, NSTEPS, gradient, initial, reference_kwargs  # noqa: E402


def _flax_stand_in() -> None:
    linen = types.ModuleType("flax.linen")
    linen.Partitioned = type("Partitioned", (), {})
    flax = types.ModuleType("flax")
    flax.linen = linen
    sys.modules["flax"], sys.modules["flax.linen"] = flax, linen


def run(config: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from psgd_jax.kron import kron

    x = {k: jnp.asarray(v) for k, v in initial().items()}
    txs = {k: kron(**reference_kwargs(config)) for k in x}
    states = {k: txs[k].init({k: x[k]}) for k in x}
    updates = {k: jax.jit(txs[k].update) for k in x}
    out = {k: [] for k in x}
    for t in range(NSTEPS):
        g = gradient({k: np.asarray(v) for k, v in x.items()}, t)
        for k in x:
            u, states[k] = updates[k]({k: jnp.asarray(g[k])}, states[k], {k: x[k]})
            x[k] = x[k] + u[k]
            out[k].append(np.asarray(x[k], np.float64))
    return {k: np.stack(v) for k, v in out.items()}


def main(path: str) -> None:
    import jax
    jax.config.update("jax_enable_x64", True)
    _flax_stand_in()
    arrays = {}
    for name, config in CONFIGS.items():
        for k, v in run(config).items():
            arrays[f"{name}/{k}"] = v
    np.savez_compressed(path, **arrays)
    print(f"wrote {path}: {', '.join(CONFIGS)}")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "kron_reference.npz"))
