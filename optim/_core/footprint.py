"""`state_bytes`: what an optimiser state costs in memory."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .state import State

__all__ = ["state_bytes"]


def state_bytes(state: State) -> int:
    """The bytes of the optimiser state: every array it stores per parameter (moments, a quantised moment's
    codes and scales, counters such as Adam's `bt`, packed or not) and the step counter; a tie group's state is
    stored once and counts once. Hyperparameters, which `state.rules` holds, do not count. Shapes and dtypes
    are read, not values: it works on a traced or abstract state (`jax.eval_shape(optim.setup, ...)`) too.

    >>> import jax.numpy as jnp, optim
    >>> w = jnp.zeros((1000,))
    >>> # m, v: 2 x 4000 bytes; bt, step: 12 bytes
    >>> optim.state_bytes(optim.setup(optim.Adam(), {"a": w, "b": w}))
    8012
    """
    if not isinstance(state, State):
        raise TypeError(f"state_bytes takes an optim State (from optim.setup), got {type(state).__name__}")
    leaves = jax.tree.leaves((state.stored, state.packs, state.step))
    return int(sum(math.prod(np.shape(a)) * jnp.dtype(a.dtype).itemsize for a in leaves))
