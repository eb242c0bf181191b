"""Schedules: a hyperparameter that depends on the step, `lr=optim.Cosine(1e-3, 10_000)`.

A schedule is a pytree whose numbers are leaves; `update` evaluates it on device from the state's step counter
(the number of `update` calls so far, starting at 0), so changing its numbers with `adjust` never recompiles.
Any hyperparameter of any rule may be a schedule.
"""

from __future__ import annotations

from typing import Any, Union

import jax
import jax.numpy as jnp

from . import _hyper
from ._tree import register_struct, struct_repr

__all__ = ["Schedule", "Constant", "Linear", "Cosine", "Piecewise", "Join", "warmup_cosine", "resolve"]


class Schedule:
    """Base class: `schedule(step) -> value`, with `step` an integer scalar (possibly traced).

    The constructor checks concrete numbers (`optim._hyper`): values are finite and stored as floats (so
    `adjust` never truncates a schedule given as ints); lengths are >= 0, and > 0 where the formula divides by
    them, so that no schedule ever yields NaN.
    """

    _static: tuple[str, ...] = ()
    _values: tuple[str, ...] = ()      # numbers, or tuples of numbers: finite, stored as floats
    _lengths: tuple[str, ...] = ()     # step counts, or tuples of them: >= 0
    _divisors: tuple[str, ...] = ()    # lengths the formula divides by: > 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_struct(cls, cls._static)

    def __post_init__(self):
        owner = type(self).__name__
        for name in self._values:
            v = getattr(self, name)
            if isinstance(v, (tuple, list)):
                v = tuple(_hyper.hyper(owner, f"{name}[{k}]", u, "any") for k, u in enumerate(v))
            else:
                v = _hyper.hyper(owner, name, v, "any")
            object.__setattr__(self, name, v)
        for name in self._lengths + self._divisors:
            v = getattr(self, name)
            if isinstance(v, (tuple, list)):
                v = tuple(_hyper.length(owner, f"{name}[{k}]", u, name in self._divisors) for k, u in enumerate(v))
            else:
                v = _hyper.length(owner, name, v, name in self._divisors)
            object.__setattr__(self, name, v)

    def __call__(self, step: Any) -> jax.Array:
        raise NotImplementedError

    def __repr__(self) -> str:
        return struct_repr(self)


# What a hyperparameter field holds: a number, an array (a tracer under jit) or a schedule.
Hyper = Union[float, jax.Array, Schedule]


def _t(step: Any, like: Any) -> jax.Array:
    dtype = jnp.result_type(jnp.asarray(like).dtype, jnp.float32)
    return jnp.asarray(step).astype(dtype)


def _frac(t: jax.Array, steps: Any) -> jax.Array:
    """`clip(t / steps, 0, 1)`; 1 for a length that is not positive (only possible for a traced length, which
    the constructor could not check), never NaN."""
    steps = jnp.asarray(steps, t.dtype)
    ok = steps > 0
    return jnp.where(ok, jnp.clip(t / jnp.where(ok, steps, 1), 0, 1), 1)


class Constant(Schedule):
    """`value` at every step."""

    value: Any
    _values = ("value",)

    def __call__(self, step):
        return jnp.asarray(self.value)


class Linear(Schedule):
    """From `start` to `end` linearly over `steps` steps, then `end`."""

    start: Any
    end: Any
    steps: Any
    _values = ("start", "end")
    _divisors = ("steps",)

    def __call__(self, step):
        frac = _frac(_t(step, self.start), self.steps)
        return self.start + (self.end - self.start) * frac


class Cosine(Schedule):
    """Cosine decay from `init` to `final` over `steps` steps: `final + (init - final)(1 + cos(π t/T)) / 2`."""

    init: Any
    steps: Any
    final: Any = 0.0
    _values = ("init", "final")
    _divisors = ("steps",)

    def __call__(self, step):
        frac = _frac(_t(step, self.init), self.steps)
        return self.final + (self.init - self.final) * 0.5 * (1 + jnp.cos(jnp.pi * frac))


class Piecewise(Schedule):
    """Piecewise constant: `values[k]` for `boundaries[k-1] <= step < boundaries[k]`
    (`len(values) == len(boundaries) + 1`)."""

    boundaries: tuple
    values: tuple
    _values = ("values",)
    _lengths = ("boundaries",)

    def __post_init__(self):
        if not isinstance(self.boundaries, (tuple, list)) or not isinstance(self.values, (tuple, list)):
            raise TypeError("Piecewise: boundaries and values are tuples, "
                            "e.g. Piecewise((100, 200), (1e-3, 1e-4, 1e-5))")
        if len(self.values) != len(self.boundaries) + 1:
            raise ValueError("Piecewise: need one more value than boundaries")
        super().__post_init__()

    def __call__(self, step):
        out = jnp.asarray(self.values[0])
        for b, v in zip(self.boundaries, self.values[1:]):
            out = jnp.where(step >= b, v, out)
        return out


class Join(Schedule):
    """Schedules one after another: `schedules[k]` runs from `boundaries[k-1]`, seeing `step - boundaries[k-1]`."""

    schedules: tuple
    boundaries: tuple
    _lengths = ("boundaries",)

    def __post_init__(self):
        if not isinstance(self.schedules, (tuple, list)) or not isinstance(self.boundaries, (tuple, list)):
            raise TypeError("Join: schedules and boundaries are tuples, e.g. Join((Linear(0.0, 1.0, 10), "
                            "Cosine(1.0, 90)), (10,))")
        if len(self.schedules) != len(self.boundaries) + 1:
            raise ValueError("Join: need one more schedule than boundaries")
        for k, s in enumerate(self.schedules):
            if not isinstance(s, Schedule):
                raise TypeError(f"Join: schedules[{k}] is {type(s).__name__}, not a schedule (wrap a number in "
                                "Constant)")
        object.__setattr__(self, "schedules", tuple(self.schedules))
        super().__post_init__()

    def __call__(self, step):
        out = self.schedules[0](step)
        for b, s in zip(self.boundaries, self.schedules[1:]):
            out = jnp.where(step >= b, s(step - b), out)
        return out


def warmup_cosine(peak: float, warmup_steps: int, decay_steps: int, init: float = 0.0,
                  final: float = 0.0) -> Join:
    """Linear warmup from `init` to `peak` over `warmup_steps`, then cosine decay to `final`, reaching it at
    step `decay_steps` (counted from the start, as optax's `warmup_cosine_decay_schedule`).

    >>> s = warmup_cosine(1.0, 10, 110)
    >>> [round(float(s(t)), 3) for t in (0, 5, 10, 60, 110, 200)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    _hyper.length("warmup_cosine", "warmup_steps", warmup_steps, positive=False)
    _hyper.length("warmup_cosine", "decay_steps", decay_steps, positive=False)
    if _hyper.is_concrete(warmup_steps) and _hyper.is_concrete(decay_steps) and not decay_steps > warmup_steps:
        raise ValueError(f"warmup_cosine: decay_steps ({decay_steps}) counts from the start and must be greater "
                         f"than warmup_steps ({warmup_steps}); the cosine part has decay_steps - warmup_steps steps")
    cosine = Cosine(peak, decay_steps - warmup_steps, final)
    if _hyper.is_concrete(warmup_steps) and warmup_steps == 0:
        return Join((cosine,), ())
    return Join((Linear(init, peak, warmup_steps), cosine), (warmup_steps,))



def resolve(tree: Any, step: Any) -> Any:
    """Replace every schedule in `tree` (a rule) by its value at `step`."""
    return jax.tree.map(lambda v: v(step) if isinstance(v, Schedule) else v, tree,
                        is_leaf=lambda v: isinstance(v, Schedule))
