"""Hyperparameters: what rules and schedules accept as a number, checked and made floating at construction.

A hyperparameter is a real number: a Python or numpy number, a real jax / numpy array (usually 0-d), an optim
schedule, or a tracer (inside a traced function, where only its shape can be checked: it must be 0-d). It is
stored as a *floating* number: `Descent(1)` holds `1.0`, so that `adjust(state, lr=0.5)` later gives 0.5 and not
an integer 0 (the state keeps each hyperparameter's dtype so that a jitted step never retraces). Counts
(`AccumGrad.n`) and schedule lengths stay integers. Concrete values are checked here, the same way in a rule's
constructor and in `adjust`: a wrong type is a `TypeError`, a value out of range (negative, `inf`, `nan`, `beta`
not in [0, 1)) or an array of more than one number a `ValueError`, both naming the rule and the argument.

A schedule is checked against the same range over all its steps: its lowest and highest values follow from its
numbers (`Schedule.bounds`: `Linear(0.1, -0.1, 10)` goes down to -0.1, so it is no learning rate), taken over
every step the schedule has on its own (a part of a `Join` is checked over all its steps, also those the
`Join` does not reach); a limit it only tends to counts as reached (`Exponential(0.5, 2.0, 10)` grows past any
bound, so it is no `beta`). A schedule with traced numbers, or a user-defined one without `bounds`, is not
checked.

Structural arguments (`Muon.steps`, `Adafactor.factored`) are not hyperparameters: `flag` and `whole` check
them, a wrong type being a `TypeError` (`"no"` for a flag, `2.5` for a count) and a value out of range a
`ValueError`.
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
    """An optim schedule (`optim._rules.schedules.Schedule` marks its classes: that module imports this one)."""
    return getattr(type(v), "_optim_schedule", False)


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
        _check_schedule(owner, name, v, check)
        return v
    if not _is_numeric(v):
        raise TypeError(f"{owner}: {name} must be a real number, an array or an optim schedule, "
                        f"got {type(v).__name__} {v!r}")
    if jnp.ndim(v) != 0:     # a tracer's shape is known too (a rule built inside jit), though not its value
        raise ValueError(f"{owner}: {name} must be a scalar, got an array of shape {jnp.shape(v)}: a hyperparameter "
                         "is one number for the whole parameter (or an optim schedule, for one that changes "
                         "with the step); give parameters different values with optim.by_path or "
                         "adjust(state, pattern, ...)")
    if is_concrete(v):
        a = np.asarray(v, dtype=np.float64)
        test, says = RANGES[check]
        if not np.all(np.isfinite(a)) or not np.all(test(a)):
            raise ValueError(f"{owner}: {name} {says} and finite, got {a.item()!r}")
    return _float(v)


def _check_schedule(owner: str, name: str, s: Any, check: str) -> None:
    """A schedule for a hyperparameter: its values over all its steps (`Schedule.bounds`) must lie in the
    hyperparameter's range, as a number must.

    >>> from optim import Linear
    >>> try:
    ...     hyper("Adam", "lr", Linear(0.1, -0.1, 10))
    ... except ValueError as e:
    ...     for part in str(e).split(", but "):
    ...         print(part)
    Adam: lr must be >= 0 at every step
    the schedule Linear(start=0.1, end=-0.1, steps=10) takes values down to -0.1 (its range is [-0.1, 0.1])
    """
    bounds = getattr(s, "bounds", None)
    got = bounds() if callable(bounds) else None
    if got is None:        # traced numbers, or a schedule that does not say: checked by no one
        return
    lo, hi = got
    test, says = RANGES[check]
    bad = [b for b in (lo, hi) if not test(np.float64(b))]
    if bad:
        where = "down to" if bad[0] == lo else "up to"
        raise ValueError(f"{owner}: {name} {says} at every step, but the schedule {s!r} takes values {where} "
                         f"{bad[0]:g} (its range is [{lo:g}, {hi:g}])")


def flag(owner: str, name: str, v: Any) -> bool:
    """A structural switch (`Adafactor.factored`): True or False (numpy's bools too), as a Python bool.

    >>> flag("Lars", "nesterov", "no")
    Traceback (most recent call last):
    ...
    TypeError: Lars: nesterov must be True or False, got str 'no'
    """
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{owner}: {name} must be True or False, got {type(v).__name__} {v!r}")
    return bool(v)


def whole(owner: str, name: str, v: Any, minimum: int, why: str = "") -> int:
    """A structural integer (`Muon.steps`): a Python or numpy integer (not a bool, a float or a string), at least
    `minimum`, as a Python int. `why` says what a smaller value would do.

    >>> whole("Muon", "steps", 2.5, 1)
    Traceback (most recent call last):
    ...
    TypeError: Muon: steps must be an integer, got float 2.5
    """
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{owner}: {name} must be an integer, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {v!r}" + (f" ({why})" if why else ""))
    return int(v)


def numbers(owner: str, name: str, v: Any, check: str, example: tuple = (0.9, 0.999)) -> tuple:
    """A hyperparameter that is a tuple of `len(example)` numbers (`beta=(0.9, 0.999)`: a pair), each checked like
    `hyper` and named by its index (`beta[1]`). A list is taken as a tuple.

    >>> numbers("Adam", "beta", [0.9, 0], "unit")
    (0.9, 0.0)
    >>> numbers("Adan", "beta", (0.9, 0.99), "unit", example=(0.98, 0.92, 0.99))
    Traceback (most recent call last):
    ...
    TypeError: Adan: beta must be a tuple of 3 numbers such as beta=(0.98, 0.92, 0.99), got tuple (0.9, 0.99)
    """
    if isinstance(v, list):
        v = tuple(v)
    n = len(example)
    if not isinstance(v, tuple) or len(v) != n:
        what = "a pair of numbers" if n == 2 else f"a tuple of {n} numbers"
        shown = "(0.9, 0.999)" if n == 2 else repr(tuple(example))
        raise TypeError(f"{owner}: {name} must be {what} such as {name}={shown}, got {type(v).__name__} {v!r}")
    return tuple(hyper(owner, f"{name}[{k}]", u, check) for k, u in enumerate(v))


def count(owner: str, name: str, v: Any, minimum: int = 1) -> Any:
    """A hyperparameter that counts something (`AccumGrad.n`): an integer >= `minimum`, stored as given."""
    if isinstance(v, (bool, np.bool_)) or not _is_numeric(v):
        raise TypeError(f"{owner}: {name} must be an integer, got {type(v).__name__} {v!r}")
    if jnp.ndim(v) != 0:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got an array of shape {jnp.shape(v)}")
    if is_concrete(v):
        a = np.asarray(v, dtype=np.float64)
        if not np.isfinite(a) or a != np.round(a) or a < minimum:
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
    """Python and numpy numbers in `tree` as strong-typed device scalars (int32, or the default float). Made
    now, also inside a traced function (`setup` on a closed-over model inside `jit`): constants, not tracers."""

    def conv(v):
        if isinstance(v, (bool, np.bool_)):
            return v
        if isinstance(v, (int, np.integer)):
            return jnp.asarray(v, jnp.int32)
        if isinstance(v, (float, np.floating)) or (isinstance(v, np.ndarray) and v.ndim == 0):
            return jnp.asarray(v, jax.dtypes.canonicalize_dtype(jnp.float64))
        return v

    with jax.ensure_compile_time_eval():
        return jax.tree.map(conv, tree)
