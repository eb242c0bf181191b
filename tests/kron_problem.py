"""The problem Kron is compared on (tests/test_kron.py, tests/data/make_kron_reference.py): a few parameters (a
square matrix, a matrix with an axis longer than `max_size_triangular` in one configuration, a 3-axis array, a
vector and a scalar), a gradient that depends on the parameter and the step, and configurations in optim's
keywords with psgd-jax's (`reference_kwargs`). `SEED` is psgd-jax's fixed seed: the reference run one parameter
at a time draws the random numbers optim draws with it. 160 steps: with x64 the factors are balanced at count 151.
"""

from __future__ import annotations

import numpy as np

NSTEPS = 160
SEED = 5318008
SHAPES = {"w": (6, 6), "r": (5, 7), "t": (3, 4, 2), "b": (5,), "c": ()}

CONFIGS = {
    "defaults": dict(seed=SEED),
    "switches": dict(lr=0.05, b1=0.5, weight_decay=0.1, preconditioner_update_probability=0.5,
                     max_size_triangular=6, precond_lr=0.3, seed=SEED),
    "no_momentum": dict(lr=0.02, b1=0.0, precond_lr=0.2, seed=SEED),
}
DEFAULTS = dict(lr=1e-3, b1=0.9, weight_decay=0.0, preconditioner_update_probability=1.0, max_size_triangular=8192,
                precond_lr=0.1, seed=0)
for _c in CONFIGS.values():
    for _k, _v in DEFAULTS.items():
        _c.setdefault(_k, _v)


def reference_kwargs(c: dict) -> dict:
    """psgd_jax.kron's arguments for optim's configuration `c` (its seed is fixed: 5318008)."""
    return dict(learning_rate=c["lr"], b1=c["b1"], weight_decay=c["weight_decay"],
                preconditioner_update_probability=c["preconditioner_update_probability"],
                max_size_triangular=c["max_size_triangular"], preconditioner_lr=c["precond_lr"])


def initial() -> dict:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s) for k, s in SHAPES.items()}


def _targets_and_noise() -> tuple[dict, list[dict]]:
    rng = np.random.default_rng(1)
    target = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    noise = [{k: rng.standard_normal(s) for k, s in SHAPES.items()} for _ in range(NSTEPS)]
    return target, noise


_TARGET, _NOISE = _targets_and_noise()


def gradient(params: dict, t: int) -> dict:
    """The gradient at step `t` (0-based): `(x - T) / 2 + N_t / 4`."""
    return {k: 0.5 * (np.asarray(x, np.float64) - _TARGET[k]) + 0.25 * _NOISE[t][k] for k, x in params.items()}
