"""The problem Shampoo is compared on (tests/test_shampoo.py, tests/data/make_shampoo_reference.py): a few
parameters (a matrix in one block, a matrix cut into uneven blocks, a 3-axis array, a vector and a scalar), a
gradient that depends on the parameter and the step, and configurations in optim's keywords with, for those
precondition-opt's `distributed_shampoo` can run, its keywords (`REFERENCE`).
"""

from __future__ import annotations

import numpy as np

NSTEPS = 12
SHAPES = {"w": (6, 6), "r": (5, 7), "t": (3, 4, 2), "b": (5,), "c": ()}

CONFIGS = {
    # the defaults: 12 steps are all before start_preconditioning_step (the Adam graft and its momentum)
    "defaults": dict(),
    "adam": dict(lr=0.05, beta=(0.8, 0.95), block_size=3, precondition_every=2, start_preconditioning_step=1,
                 matrix_eps=1e-4, weight_decay=0.1),
    "rmsprop": dict(lr=0.05, beta=(0.9, 0.99), block_size=3, precondition_every=2, start_preconditioning_step=3,
                    graft="rmsprop", matrix_eps=1e-4, weight_decay=0.1, diagonal_eps=1e-8),
    "sgd": dict(lr=0.02, beta=(0.5, 0.9), block_size=4, precondition_every=3, start_preconditioning_step=0,
                graft="sgd", matrix_eps=1e-3, nesterov=False),
    "adagrad": dict(lr=0.05, beta=(0.7, 0.9), precondition_every=1, start_preconditioning_step=1, graft="adagrad"),
}
DEFAULTS = dict(lr=1e-3, beta=(0.9, 0.999), block_size=1024, precondition_every=100, start_preconditioning_step=101,
                graft="adam", matrix_eps=1e-6, weight_decay=0.0, diagonal_eps=1e-10, nesterov=True)
for _c in CONFIGS.values():
    for _k, _v in DEFAULTS.items():
        _c.setdefault(_k, _v)

# precondition-opt has no Adam graft: the configurations it runs, with the arguments of `distributed_shampoo`
# that give optim's algorithm (its decoupled weight decay is multiplied by the learning rate twice)
GRAFT_TYPES = {"sgd": 1, "adagrad": 2, "rmsprop": 3}   # its GraftingType
REFERENCE = ("rmsprop", "sgd", "adagrad")


def reference_kwargs(c: dict) -> dict:
    return dict(learning_rate=c["lr"], block_size=c["block_size"], beta1=c["beta"][0], beta2=c["beta"][1],
                diagonal_epsilon=c["diagonal_eps"], matrix_epsilon=c["matrix_eps"],
                weight_decay=c["weight_decay"] / c["lr"], decoupled_weight_decay=True,
                start_preconditioning_step=c["start_preconditioning_step"],
                preconditioning_compute_steps=c["precondition_every"], graft_type=GRAFT_TYPES[c["graft"]],
                nesterov=c["nesterov"], best_effort_shape_interpretation=False, skip_preconditioning_rank_lt=2,
                skip_preconditioning_dim_size_gt=10 ** 9, eigh=True)


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
    """The gradient at step `t` (0-based): `(x - T) / 2 + N_t`."""
    return {k: 0.5 * (np.asarray(x, np.float64) - _TARGET[k]) + _NOISE[t][k] for k, x in params.items()}
