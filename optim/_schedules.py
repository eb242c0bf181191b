"""Schedules: a hyperparameter that depends on the step, `lr=optim.Cosine(1e-3, 10_000)`.

A schedule is a pytree whose numbers are leaves; `update` evaluates it on device from the state's step counter
(the number of `update` calls so far, starting at 0), so changing its numbers with `adjust` never recompiles.
Any hyperparameter of any rule may be a schedule.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._tree import register_struct, struct_repr

__all__ = ["Schedule", "Constant", "Linear", "Cosine", "Piecewise", "Join", "warmup_cosine", "resolve"]


class Schedule:
    """Base class: `schedule(step) -> value`, with `step` an integer scalar (possibly traced)."""

    _static: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_struct(cls, cls._static)

    def __call__(self, step: Any) -> jax.Array:
        raise NotImplementedError

    def __repr__(self) -> str:
        return struct_repr(self)


def _t(step: Any, like: Any) -> jax.Array:
    dtype = jnp.result_type(jnp.asarray(like).dtype, jnp.float32)
    return jnp.asarray(step).astype(dtype)


class Constant(Schedule):
    """`value` at every step."""

    value: Any

    def __call__(self, step):
        return jnp.asarray(self.value)


class Linear(Schedule):
    """From `start` to `end` linearly over `steps` steps, then `end`."""

    start: Any
    end: Any
    steps: Any

    def __call__(self, step):
        frac = jnp.clip(_t(step, self.start) / self.steps, 0, 1)
        return self.start + (self.end - self.start) * frac


class Cosine(Schedule):
    """Cosine decay from `init` to `final` over `steps` steps: `final + (init - final)(1 + cos(π t/T)) / 2`."""

    init: Any
    steps: Any
    final: Any = 0.0

    def __call__(self, step):
        frac = jnp.clip(_t(step, self.init) / self.steps, 0, 1)
        return self.final + (self.init - self.final) * 0.5 * (1 + jnp.cos(jnp.pi * frac))


class Piecewise(Schedule):
    """Piecewise constant: `values[k]` for `boundaries[k-1] <= step < boundaries[k]`
    (`len(values) == len(boundaries) + 1`)."""

    boundaries: tuple
    values: tuple

    def __post_init__(self):
        if len(self.values) != len(self.boundaries) + 1:
            raise ValueError("Piecewise: need one more value than boundaries")

    def __call__(self, step):
        out = jnp.asarray(self.values[0])
        for b, v in zip(self.boundaries, self.values[1:]):
            out = jnp.where(step >= b, v, out)
        return out


class Join(Schedule):
    """Schedules one after another: `schedules[k]` runs from `boundaries[k-1]`, seeing `step - boundaries[k-1]`."""

    schedules: tuple
    boundaries: tuple

    def __post_init__(self):
        if len(self.schedules) != len(self.boundaries) + 1:
            raise ValueError("Join: need one more schedule than boundaries")

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
    return Join((Linear(init, peak, warmup_steps), Cosine(peak, decay_steps - warmup_steps, final)),
                (warmup_steps,))


def resolve(tree: Any, step: Any) -> Any:
    """Replace every schedule in `tree` (a rule) by its value at `step`."""
    return jax.tree.map(lambda v: v(step) if isinstance(v, Schedule) else v, tree,
                        is_leaf=lambda v: isinstance(v, Schedule))
