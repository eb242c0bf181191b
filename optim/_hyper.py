"""Hyperparameters: what rules and schedules accept as a number, checked and made floating at construction.

A hyperparameter is a real number: a Python or numpy number, a real jax / numpy array (usually 0-d), an optim
schedule, or a tracer (inside a traced function, where it cannot be checked). It is stored as a *floating*
number: `Descent(1)` holds `1.0`, so that `adjust(state, lr=0.5)` later gives 0.5 and not an integer 0 (the
state keeps each hyperparameter's dtype so that a jitted step never retraces). Counts (`AccumGrad.n`) and
schedule lengths stay integers. Concrete values are checked here, the same way in a rule's constructor and in
`adjust`: a wrong type is a `TypeError`, a value out of range (negative, `inf`, `nan`, `beta` not in [0, 1))
a `ValueError`, both naming the rule and the argument.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


# Range checks, by name: (test on a float array, how the message says it).
RANGES = {
    "nonneg": (lambda a: a >= 0, "must be >= 0"),
    "positive": (lambda a: a > 0, "must be > 0"),
    "unit": (lambda a: (a >= 0) & (a < 1), "must be in [0, 1)"),
    "closed_unit": (lambda a: (a >= 0) & (a <= 1), "must be in [0, 1]"),
    "any": (lambda a: a == a, "must be a number"),
}


def is_schedule(v: Any) -> bool:
    from ._schedules import Schedule   # _schedules imports this module

    return isinstance(v, Schedule)


def is_concrete(v: Any) -> bool:
    """Not a tracer: a value the constructor can check."""
    return not isinstance(v, jax.core.Tracer)


def _is_numeric(v: Any) -> bool:
    """A real number or real array (bool and complex are not hyperparameters)."""
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, (int, float, np.integer, np.floating)):
        return True
    if isinstance(v, (jax.Array, np.ndarray)):
        return jnp.issubdtype(v.dtype, jnp.integer) or jnp.issubdtype(v.dtype, jnp.floating)
    return False


def _float(v: Any) -> Any:
    """`v` as a floating number, keeping its kind (Python float, numpy or jax array)."""
    if isinstance(v, (int, np.integer)):
        return float(v)
    if isinstance(v, np.ndarray) and not jnp.issubdtype(v.dtype, jnp.floating):
        return v.astype(np.float64)
    if isinstance(v, jax.Array) and not jnp.issubdtype(v.dtype, jnp.floating):
        return jnp.asarray(v, jax.dtypes.canonicalize_dtype(jnp.float64))
    return v


def hyper(owner: str, name: str, v: Any, check: str = "nonneg") -> Any:
    """Check one hyperparameter value and return it in its stored (floating) form.

    `check` names the range (see `RANGES`); schedules are checked by their own constructors.

    >>> hyper("Descent", "lr", 1)
    1.0
    >>> hyper("Descent", "lr", "0.1")
    Traceback (most recent call last):
    ...
    TypeError: Descent: lr must be a real number, an array or an optim schedule, got str '0.1'
    """
    if is_schedule(v):
        return v
    if not _is_numeric(v):
        raise TypeError(f"{owner}: {name} must be a real number, an array or an optim schedule, "
                        f"got {type(v).__name__} {v!r}")
    if is_concrete(v):
        a = np.asarray(v, dtype=np.float64)
        test, says = RANGES[check]
        if not np.all(np.isfinite(a)) or not np.all(test(a)):
            shown = a.item() if a.ndim == 0 else a
            raise ValueError(f"{owner}: {name} {says} and finite, got {shown!r}")
    return _float(v)


def pair(owner: str, name: str, v: Any, check: str) -> tuple:
    """A hyperparameter that is a pair of numbers (`beta=(0.9, 0.999)`), each checked like `hyper`."""
    if isinstance(v, list):
        v = tuple(v)
    if not isinstance(v, tuple) or len(v) != 2:
        raise TypeError(f"{owner}: {name} must be a pair of numbers such as {name}=(0.9, 0.999), "
                        f"got {type(v).__name__} {v!r}")
    return tuple(hyper(owner, f"{name}[{k}]", u, check) for k, u in enumerate(v))


def count(owner: str, name: str, v: Any, minimum: int = 1) -> Any:
    """A hyperparameter that counts something (`AccumGrad.n`): an integer >= `minimum`, stored as given."""
    if isinstance(v, (bool, np.bool_)) or not _is_numeric(v):
        raise TypeError(f"{owner}: {name} must be an integer, got {type(v).__name__} {v!r}")
    if is_concrete(v):
        a = np.asarray(v, dtype=np.float64)
        if a.ndim != 0 or not np.isfinite(a) or a != np.round(a) or a < minimum:
            raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {v!r}")
        if isinstance(v, float):
            return int(v)
    return v


def length(owner: str, name: str, v: Any, positive: bool) -> Any:
    """A schedule length (steps, a boundary): a finite number >= 0, or > 0 where the formula divides by it."""
    if isinstance(v, (bool, np.bool_)) or not _is_numeric(v):
        raise TypeError(f"{owner}: {name} must be a number of steps, got {type(v).__name__} {v!r}")
    if is_concrete(v):
        a = np.asarray(v, dtype=np.float64)
        if not np.all(np.isfinite(a)) or not np.all(a > 0 if positive else a >= 0):
            why = "> 0 (the schedule divides by it)" if positive else ">= 0"
            raise ValueError(f"{owner}: {name} must be {why} and finite, got {v!r}")
    return v


def canonical_numbers(tree: Any) -> Any:
    """Python and numpy numbers in `tree` as strong-typed device scalars (int32, or the default float)."""

    def conv(v):
        if isinstance(v, (bool, np.bool_)):
            return v
        if isinstance(v, (int, np.integer)):
            return jnp.asarray(v, jnp.int32)
        if isinstance(v, (float, np.floating)) or (isinstance(v, np.ndarray) and v.ndim == 0):
            return jnp.asarray(v, jax.dtypes.canonicalize_dtype(jnp.float64))
        return v

    return jax.tree.map(conv, tree)
