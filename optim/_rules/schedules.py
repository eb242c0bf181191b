"""Schedules: a hyperparameter that depends on the step, `lr=optim.Cosine(1e-3, 10_000)`.

A schedule is a pytree whose numbers are leaves; `update` evaluates it on device from the state's step counter
(the number of `update` calls so far, starting at 0), so changing its numbers with `adjust` never recompiles.
Any hyperparameter of any rule may be a schedule.
"""

from __future__ import annotations

import math
from typing import Any, Union

import jax
import jax.numpy as jnp

from . import hyper as _hyper
from .._base.tree import register_struct, struct_repr

__all__ = ["Schedule", "Constant", "Linear", "Cosine", "Piecewise", "Join", "warmup_cosine", "WSD", "InvSqrt",
           "Exponential", "Polynomial", "resolve"]


class Schedule:
    """Base class: `schedule(step) -> value`, with `step` an integer scalar (possibly traced).

    The constructor checks concrete numbers: values are finite and stored as floats (so
    `adjust` never truncates a schedule given as ints), and > 0 where the formula needs it (`_positive`);
    lengths are >= 0, and > 0 where the formula divides by them, so that no schedule ever yields NaN.

    `bounds()` gives the lowest and highest value over all steps (a limit the schedule tends to counts as
    reached), from its numbers alone, or None when they are traced. A rule's constructor and `adjust` check it
    against the hyperparameter's range, as they check a number: `Adam(Linear(0.1, -0.1, 10))` is a `ValueError`.
    A schedule of your own may define it too; without it, it is not checked.
    """

    _optim_schedule = True     # what `optim._rules.hyper.is_schedule` looks for

    _static: tuple[str, ...] = ()
    _values: tuple[str, ...] = ()      # numbers, or tuples of numbers: finite, stored as floats
    _positive: tuple[str, ...] = ()    # numbers that must be > 0 (a base, an exponent): finite, stored as floats
    _lengths: tuple[str, ...] = ()     # step counts, or tuples of them: >= 0
    _divisors: tuple[str, ...] = ()    # lengths the formula divides by: > 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_struct(cls, cls._static)

    def __post_init__(self):
        owner = type(self).__name__
        for name in self._values + self._positive:
            v = getattr(self, name)
            for k, u in enumerate(v) if isinstance(v, (tuple, list)) else [(None, v)]:
                _no_schedule(owner, name if k is None else f"{name}[{k}]", u)
        for name in self._values:
            v = getattr(self, name)
            if isinstance(v, (tuple, list)):
                v = tuple(_hyper.hyper(owner, f"{name}[{k}]", u, "any") for k, u in enumerate(v))
            else:
                v = _hyper.hyper(owner, name, v, "any")
            object.__setattr__(self, name, v)
        for name in self._positive:
            object.__setattr__(self, name, _hyper.hyper(owner, name, getattr(self, name), "positive"))
        for name in self._lengths + self._divisors:
            v = getattr(self, name)
            if isinstance(v, (tuple, list)):
                v = tuple(_hyper.length(owner, f"{name}[{k}]", u, name in self._divisors) for k, u in enumerate(v))
            else:
                v = _hyper.length(owner, name, v, name in self._divisors)
            object.__setattr__(self, name, v)

    def __call__(self, step: Any) -> jax.Array:
        raise NotImplementedError

    def bounds(self) -> tuple[float, float] | None:
        """`(lowest, highest)` value over all steps, or None when unknown (see the class docstring)."""
        return None

    def __repr__(self) -> str:
        return struct_repr(self)


def _no_schedule(owner: str, name: str, v: Any) -> None:
    if isinstance(v, Schedule):
        raise TypeError(f"{owner}: {name} must be a number, got the schedule {v!r}: a schedule's numbers are fixed "
                        "(run schedules one after another with optim.Join)")


def _span(*values: Any) -> tuple[float, float] | None:
    """`(min, max)` of numbers, or None when one is traced (its value is not known here)."""
    if not all(_hyper.is_concrete(v) for v in values):
        return None
    vs = [float(v) for v in values]
    return min(vs), max(vs)


def _sorted(owner: str, boundaries: tuple) -> None:
    """Boundaries are steps in increasing order (equal ones make an empty piece); refuse them out of order."""
    known = [(k, b) for k, b in enumerate(boundaries) if _hyper.is_concrete(b)]
    for (j, a), (k, b) in zip(known, known[1:]):
        if b < a:
            raise ValueError(f"{owner}: boundaries must be in increasing order (each is the step where the next "
                             f"piece starts), but boundaries[{k}] = {b!r} comes after boundaries[{j}] = {a!r}")


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

    def bounds(self):
        return _span(self.value)


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

    def bounds(self):
        return _span(self.start, self.end)


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

    def bounds(self):
        return _span(self.init, self.final)


class Piecewise(Schedule):
    """Piecewise constant: `values[k]` for `boundaries[k-1] <= step < boundaries[k]`
    (`len(values) == len(boundaries) + 1`). Boundaries are in increasing order (equal ones give a piece of no
    steps); its range (`bounds`) is that of all `values`, also those of empty pieces."""

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
        _sorted("Piecewise", self.boundaries)

    def __call__(self, step):
        out = jnp.asarray(self.values[0])
        for b, v in zip(self.boundaries, self.values[1:]):
            out = jnp.where(step >= b, v, out)
        return out

    def bounds(self):
        return _span(*self.values)


class Join(Schedule):
    """Schedules one after another: `schedules[k]` runs from `boundaries[k-1]`, seeing `step - boundaries[k-1]`.

    Boundaries are in increasing order. Its range (`bounds`) spans its parts' ranges, each over all the part's
    steps (also those after the next boundary, which the `Join` never reaches): a conservative range, known from
    the parts' numbers alone."""

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
        _sorted("Join", self.boundaries)

    def __call__(self, step):
        out = self.schedules[0](step)
        for b, s in zip(self.boundaries, self.schedules[1:]):
            out = jnp.where(step >= b, s(step - b), out)
        return out

    def bounds(self):
        parts = [s.bounds() for s in self.schedules]
        if any(b is None for b in parts):
            return None
        return min(lo for lo, _ in parts), max(hi for _, hi in parts)


def warmup_cosine(peak: float, warmup_steps: int, decay_steps: int, init: float = 0.0,
                  final: float = 0.0) -> Join:
    """Linear warmup from `init` to `peak` over `warmup_steps`, then cosine decay to `final`, reaching it at
    step `decay_steps` (counted from the start, as optax's `warmup_cosine_decay_schedule`).

    >>> s = warmup_cosine(1.0, 10, 110)
    >>> [round(float(s(t)), 3) for t in (0, 5, 10, 60, 110, 200)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    for name, v in (("peak", peak), ("init", init), ("final", final)):   # named as the caller wrote them
        _no_schedule("warmup_cosine", name, v)
        _hyper.hyper("warmup_cosine", name, v, "any")
    _hyper.length("warmup_cosine", "warmup_steps", warmup_steps, positive=False)
    _hyper.length("warmup_cosine", "decay_steps", decay_steps, positive=False)
    if _hyper.is_concrete(warmup_steps) and _hyper.is_concrete(decay_steps) and not decay_steps > warmup_steps:
        raise ValueError(f"warmup_cosine: decay_steps ({decay_steps}) counts from the start and must be greater "
                         f"than warmup_steps ({warmup_steps}); the cosine part has decay_steps - warmup_steps steps")
    cosine = Cosine(peak, decay_steps - warmup_steps, final)
    if _hyper.is_concrete(warmup_steps) and warmup_steps == 0:
        return Join((cosine,), ())
    return Join((Linear(init, peak, warmup_steps), cosine), (warmup_steps,))


_WSD_SHAPES = ("linear", "cosine", "1-sqrt")


class WSD(Schedule):
    """Warmup-stable-decay: linear warmup from 0 to `peak` over `warmup` steps, `peak` for `stable` steps, then
    decay to `final` over `decay` steps, then `final`.

    With `frac = (step - warmup - stable) / decay` in [0, 1], the decay is `peak + (final - peak) frac` for
    `shape="linear"`, `final + (peak - final)(1 + cos(π frac)) / 2` for `"cosine"` and
    `final + (peak - final)(1 - sqrt(frac))` for `"1-sqrt"`. The warmup gives `peak * step / warmup` (0 at step 0,
    `peak` from step `warmup` on). `warmup` and `stable` may be 0 (no such phase); `decay` may not. `shape` is
    part of the schedule's structure: `adjust` to a WSD of another shape recompiles.

    >>> s = WSD(1.0, 10, 20, 10, final=0.1)
    >>> [round(float(s(t)), 3) for t in (0, 5, 10, 29, 30, 35, 40, 100)]
    [0.0, 0.5, 1.0, 1.0, 1.0, 0.55, 0.1, 0.1]
    >>> s = WSD(1.0, 0, 0, 4, shape="1-sqrt")
    >>> [round(float(s(t)), 3) for t in (0, 1, 4, 5)]
    [1.0, 0.5, 0.0, 0.0]
    """

    peak: Any
    warmup: Any
    stable: Any
    decay: Any
    final: Any = 0.0
    shape: str = "linear"
    _static = ("shape",)
    _values = ("peak", "final")
    _lengths = ("warmup", "stable")
    _divisors = ("decay",)

    def __post_init__(self):
        if not isinstance(self.shape, str) or self.shape not in _WSD_SHAPES:
            raise ValueError(f"WSD: shape must be one of {', '.join(map(repr, _WSD_SHAPES))}, got {self.shape!r}")
        super().__post_init__()

    def __call__(self, step):
        t = _t(step, self.peak)
        warm = self.peak * _frac(t, self.warmup)
        frac = _frac(t - self.warmup - self.stable, self.decay)
        if self.shape == "linear":
            down = self.peak + (self.final - self.peak) * frac
        elif self.shape == "cosine":
            down = self.final + (self.peak - self.final) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        else:
            down = self.final + (self.peak - self.final) * (1 - jnp.sqrt(frac))
        return jnp.where(t < self.warmup, warm, jnp.where(t < self.warmup + self.stable, self.peak, down))

    def bounds(self):
        # the warmup starts at 0 (a traced warmup may be > 0)
        no_warmup = _hyper.is_concrete(self.warmup) and self.warmup == 0
        return _span(self.peak, self.final) if no_warmup else _span(0.0, self.peak, self.final)


class InvSqrt(Schedule):
    """Inverse square root with linear warmup: `peak * step / warmup` before step `warmup`, then
    `peak * sqrt(warmup / step)` (`peak` at step `warmup`).

    `warmup` must be > 0 (the formula divides by it; with 0 it would be 0 at every step after the first). A
    traced `warmup <= 0`, which the constructor cannot check, gives that limit: `peak` at step 0, then 0.

    >>> s = InvSqrt(1.0, 4)
    >>> [round(float(s(t)), 3) for t in (0, 2, 4, 16, 100)]
    [0.0, 0.5, 1.0, 0.5, 0.2]
    """

    peak: Any
    warmup: Any
    _values = ("peak",)
    _divisors = ("warmup",)

    def __call__(self, step):
        t = _t(step, self.peak)
        w = jnp.asarray(self.warmup, t.dtype)
        ok = w > 0
        safe = jnp.where(ok, w, 1)
        factor = jnp.where(t < safe, t / safe, jnp.sqrt(safe / jnp.maximum(t, safe)))
        return self.peak * jnp.where(ok, factor, jnp.where(t <= 0, 1.0, 0.0))

    def bounds(self):
        return _span(0.0, self.peak)      # 0 at step 0, the peak at `warmup`, then down towards 0


class Exponential(Schedule):
    """Exponential decay (or growth, for `rate > 1`): `init * rate ** (step / steps)`, multiplied by `rate`
    every `steps` steps; with `staircase=True` the exponent is `floor(step / steps)`, as in optax's
    `exponential_decay`.

    `rate` must be > 0 and `steps` > 0. A traced `steps <= 0`, which the constructor cannot check, gives `init`.

    >>> s = Exponential(1.0, 0.5, 10)
    >>> [round(float(s(t)), 3) for t in (0, 5, 10, 20, 30)]
    [1.0, 0.707, 0.5, 0.25, 0.125]
    >>> s = Exponential(1.0, 0.5, 10, staircase=True)
    >>> [round(float(s(t)), 3) for t in (0, 9, 10, 25)]
    [1.0, 1.0, 0.5, 0.25]
    """

    init: Any
    rate: Any
    steps: Any
    staircase: bool = False
    _static = ("staircase",)
    _values = ("init",)
    _positive = ("rate",)
    _divisors = ("steps",)

    def __post_init__(self):
        if not isinstance(self.staircase, bool):
            raise TypeError(f"Exponential: staircase must be True or False, got {self.staircase!r}")
        super().__post_init__()

    def __call__(self, step):
        t = _t(step, self.init)
        steps = jnp.asarray(self.steps, t.dtype)
        ok = steps > 0
        p = jnp.where(ok, t / jnp.where(ok, steps, 1), 0)
        if self.staircase:
            p = jnp.floor(p)
        return self.init * jnp.power(jnp.asarray(self.rate, t.dtype), p)

    def bounds(self):
        got = _span(self.init, self.rate)
        if got is None:
            return None
        init, rate = float(self.init), float(self.rate)
        limit = init if rate == 1 or init == 0 else 0.0 if rate < 1 else math.copysign(math.inf, init)
        return min(init, limit), max(init, limit)    # towards 0 (rate < 1) or without bound (rate > 1)


class Polynomial(Schedule):
    """Polynomial decay from `init` to `end` over `steps` steps, then `end`:
    `(init - end) * (1 - min(step, steps) / steps) ** power + end` (optax's `polynomial_schedule`).

    `power` must be > 0 (with 0 the schedule would stay at `init` and never reach `end`); `power=1` is `Linear`.

    >>> s = Polynomial(1.0, 0.0, 2, 10)
    >>> [round(float(s(t)), 3) for t in (0, 5, 9, 10, 20)]
    [1.0, 0.25, 0.01, 0.0, 0.0]
    """

    init: Any
    end: Any
    power: Any
    steps: Any
    _values = ("init", "end")
    _positive = ("power",)
    _divisors = ("steps",)

    def __call__(self, step):
        left = 1 - _frac(_t(step, self.init), self.steps)
        # 0 ** power is 0 for power > 0; the guard keeps a traced power <= 0 finite at the end
        return (self.init - self.end) * jnp.where(left > 0, jnp.power(left, self.power), 0) + self.end

    def bounds(self):
        return _span(self.init, self.end)



def resolve(tree: Any, step: Any) -> Any:
    """Replace every schedule in `tree` (a rule) by its value at `step`."""
    return jax.tree.map(lambda v: v(step) if isinstance(v, Schedule) else v, tree,
                        is_leaf=lambda v: isinstance(v, Schedule))


def at_start(rule: Any) -> Any:
    """`rule` with each schedule replaced by its value at step 0, for its `init` (an initial accumulator of ε,
    AMSGrad's moments started at ε): `rule` itself where it holds no schedule."""
    if not any(isinstance(v, Schedule) for v in jax.tree.leaves(rule, is_leaf=lambda v: isinstance(v, Schedule))):
        return rule
    return resolve(rule, jnp.zeros((), jnp.int32))

