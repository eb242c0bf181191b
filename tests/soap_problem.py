"""The problem SOAP is compared on (tests/test_soap.py, tests/data/make_soap_reference.py, bench/soap.py's
check): a few parameters, a gradient that depends on the parameter and the step, and configurations in the
reference's keywords (optim's names; `beta` is the reference's `betas`).

A rank-deficient Kronecker factor makes SOAP's result depend on the basis its `eigh` picks in the factor's null
space. The first gradient of a rectangular matrix and of a vector is therefore *axis-aligned* (a diagonal
matrix, a unit vector times a number): its factors are diagonal, and every `eigh` returns the unit vectors for
them, so any two implementations choose the same basis. Every later gradient is dense, and by the first refresh
(`precondition_frequency` >= 3) every factor of a matrix has full rank (a vector's, rank n - 1: its QR is
still unique up to signs).
"""

from __future__ import annotations

import numpy as np

NSTEPS = 20
SHAPES = {"w": (6, 6), "r": (4, 6), "t": (3, 4, 5), "b": (5,), "c": ()}
ALIGNED = ("r", "b")     # first gradient axis-aligned (rank-deficient factors)

CONFIGS = {
    "default_f3": dict(lr=0.05, precondition_frequency=3),
    "switches": dict(lr=0.05, beta=(0.9, 0.99), shampoo_beta=0.8, eps=1e-6, weight_decay=0.1,
                     precondition_frequency=4, max_precond_dim=5, precondition_1d=True, normalize_grads=True,
                     correct_bias=False),
    "defaults": dict(),
}
REF_DEFAULTS = dict(lr=3e-3, beta=(0.95, 0.95), shampoo_beta=None, eps=1e-8, weight_decay=0.01,
                    precondition_frequency=10, max_precond_dim=10000, precondition_1d=False, normalize_grads=False,
                    correct_bias=True)
for _c in CONFIGS.values():
    for _k, _v in REF_DEFAULTS.items():
        _c.setdefault(_k, _v)


def _aligned(shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """A diagonal matrix (or a multiple of a unit vector) of `shape`, distinct magnitudes."""
    a = np.zeros(shape)
    if len(shape) == 1:
        a[2] = 1.5
        return a
    for i in range(min(shape)):
        a[i, i] = (1.0 + 0.5 * i) * (-1) ** i
    return a


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
    """The gradient at step `t` (0-based) of the parameters: `(x - T) / 2 + N_t`, where the first one of the
    `ALIGNED` parameters is made axis-aligned."""
    x0 = initial()
    out = {}
    for k, x in params.items():
        x = np.asarray(x, np.float64)
        g = 0.5 * (x - _TARGET[k]) + _NOISE[t][k]
        if t == 0 and k in ALIGNED:
            g = g - (0.5 * (x0[k] - _TARGET[k]) + _NOISE[0][k]) + _aligned(SHAPES[k], None)
        out[k] = g
    return out
