"""Adafactor: second moments kept as row and column statistics, O(n + m) numbers for an n x m matrix."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import hyper as _hyper
from .fields import decay, flag, nonneg, static, steps
from .moments import load, mu_zeros, StateDtypes, store
from .schedules import Hyper
from .protocol import Rule, abs2, compute_dtype, real_dtype, as_compute

__all__ = ["Adafactor"]


def factored_dims(shape: tuple[int, ...], min_dim: int) -> tuple[int, int] | None:
    """The axes `(d1, d0)` whose statistics Adafactor keeps for a parameter of `shape`: the second largest and
    the largest axis (ties broken as numpy's `argsort`, as optax), or None (unfactored) when the parameter has
    fewer than 2 axes or its second largest axis is shorter than `min_dim`."""
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_dim:
        return None
    return int(order[-2]), int(order[-1])


class Adafactor(StateDtypes, Rule):
    """Adafactor (Shazeer & Stern 2018): an RMS-normalised step whose second moment is *factored*. For a
    parameter with two axes of at least `min_dim_size_to_factor` entries, with `d₀` its largest axis and `d₁`
    the second largest, only the means of `G = |g|² + ε₁` over each are kept:

    - `ρ = 1 - (t - offset)^(-c)` (`t` = 1 on the parameter's first step), `R ← ρ R + (1 - ρ) mean_{d₀} G`,
      `C ← ρ C + (1 - ρ) mean_{d₁} G`, `u = g / √(V̂)` with `V̂ = R C / mean_{d₁} R` (the rank-1 estimate);
    - any other parameter keeps the full `V ← ρ V + (1 - ρ) G`, `u = g / √V`;

    then the update is clipped by its RMS, `u ← u / max(1, RMS(u) / d)`, scaled by the learning rate and, with
    `multiply_by_parameter_scale`, by the parameter's RMS (a step relative to the parameter's size,
    `η max(ε₂, RMS(x))`), averaged with momentum `β₁` if set (`m ← β₁ m + (1 - β₁) u`, `u = m`, not
    bias-corrected), and `λ x` is added: `step = u + λ x`.

    Args:
        lr: learning rate η, default 0.01, >= 0 (with the parameter scale, a relative step size).
        decay_rate: c, the exponent of the second-moment decay `ρ`, default 0.8, >= 0.
        decay_offset: a step count subtracted from `t` in `ρ` (to restart the decay schedule when fine-tuning),
            default 0, an integer >= 0.
        clipping_threshold: d, the largest RMS of the normalised update, default 1.0, >= 0; None disables
            clipping (stored as `inf`).
        momentum: β₁ of the update average, default None: no momentum and no state for it (structural: the
            state differs; changing it between None and a number needs a new `setup`); a number in [0, 1] is
            adjustable.
        weight_decay: λ, added to the step as is (not multiplied by η, as optax's `weight_decay_rate`),
            default 0.0, >= 0.
        eps: ε₁, added to `|g|²`, default 1e-30, >= 0.
        min_scale: ε₂, the smallest parameter RMS the step is scaled by, default 1e-3, >= 0.
        factored: whether to factor the second moment of parameters with 2 or more axes, default True
            (structural).
        min_dim_size_to_factor: factor only when the second largest axis has at least this many entries,
            default 128, an integer >= 0 (structural).
        multiply_by_parameter_scale: scale the step by `max(ε₂, RMS(x))`, default True (structural).
        mu_dtype: storage dtype of the momentum `m`, default None (the parameter's dtype); structural.

    State: a dict: `count`, the parameter's number of steps (int32); `v_row` and `v_col`, the statistics over
    `d₀` and over `d₁` (shape of `x` without `d₀`, resp. without `d₁`), or `v`, the full second moment (shape of
    `x`), all in the parameter's real dtype and starting at 0; `m` (with momentum), starting at 0. Counts are per
    parameter: one with no step (a `None` gradient, frozen) keeps its `t`. A (256, 128) matrix holds
    128 + 256 + 1 numbers; a stack of same-shaped parameters stacks these.

    Reference: N. Shazeer, M. Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", 2018,
    arXiv:1804.04235.

    optax: `Adafactor(η)` is `optax.adafactor(η)`: the same factoring, formulas and defaults but one, the
    learning rate: optax's default `learning_rate=None` applies none (a factor of 1, so `optax.adafactor()` is
    `Adafactor(1.0)`), where η defaults to 0.01 here. optax's `weight_decay_rate` is `weight_decay`, its
    `dtype_momentum` (float32 by default) is `mu_dtype`. optax counts steps once for the whole tree, here per
    parameter (the same unless some parameter skips a step).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.full((256, 128), 0.5)
    >>> state = optim.setup(optim.Adafactor(0.1), x)
    >>> # factored: a row and a column statistic
    >>> {k: v.shape for k, v in state[""].state.items()}
    {'count': (), 'v_col': (256,), 'v_row': (128,)}
    >>> state, x = optim.update(state, x, jnp.ones((256, 128)))
    >>> x[0, 0]          # first step: u = g / |g| = 1, times η RMS(x) = 0.1 * 0.5
    Array(0.45, dtype=float32)
    """

    lr: Hyper = nonneg(0.01)
    decay_rate: Hyper = nonneg(0.8)
    decay_offset: Hyper = steps(0)
    clipping_threshold: Hyper | None = nonneg(1.0)
    momentum: Hyper | None = decay(None)
    weight_decay: Hyper = nonneg(0.0)
    eps: Hyper = nonneg(1e-30)
    min_scale: Hyper = nonneg(1e-3)
    factored: bool = flag(True)
    min_dim_size_to_factor: int = static(128)
    multiply_by_parameter_scale: bool = flag(True)
    mu_dtype: Any = static(None)

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "min_dim_size_to_factor",
                           _hyper.whole("Adafactor", "min_dim_size_to_factor", self.min_dim_size_to_factor, 0,
                                        "it is the length the second largest axis needs to be factored"))

    @classmethod
    def _checked(cls, name: str, v: Any) -> Any:
        if name == "clipping_threshold" and v is None:
            return math.inf      # max(1, RMS / inf) = 1: clipping off, and the field stays a number
        if name == "momentum" and v is None:
            return None
        return super()._checked(name, v)

    def _dims(self, x: jax.Array) -> tuple[int, int] | None:
        return factored_dims(x.shape, self.min_dim_size_to_factor) if self.factored else None

    def init(self, x):
        state = {"count": jnp.zeros((), jnp.int32)}
        dims = self._dims(x)
        if dims is None:
            state["v"] = jnp.zeros(x.shape, real_dtype(x))
        else:
            d1, d0 = dims
            state["v_row"] = jnp.zeros(np.delete(x.shape, d0), real_dtype(x))
            state["v_col"] = jnp.zeros(np.delete(x.shape, d1), real_dtype(x))
        if self.momentum is not None:
            state["m"] = mu_zeros(self, x)
        return state

    def apply(self, state, x, dx, *dxs):
        if (self.momentum is None) != ("m" not in state):
            raise ValueError(f"Adafactor: momentum={self.momentum!r} but the state was set up "
                             f"{'with' if 'm' in state else 'without'} momentum; changing momentum between None "
                             "and a number needs a new optim.setup")
        c = lambda v: as_compute(v, x)   # noqa: E731
        g = dx.astype(jnp.promote_types(dx.dtype, compute_dtype(x)))
        count = state["count"] + 1
        rho = 1 - (count - jnp.asarray(self.decay_offset, count.dtype)).astype(c(0).dtype) ** -c(self.decay_rate)
        g2 = abs2(g) + c(self.eps)
        dims = self._dims(x)
        if dims is None:
            (v,) = load(x, state["v"])
            moments = {"v": rho * v + (1 - rho) * g2}
            u = g * jax.lax.rsqrt(moments["v"])
        else:
            d1, d0 = dims
            r, col = load(x, state["v_row"], state["v_col"])
            r = rho * r + (1 - rho) * jnp.mean(g2, axis=d0)
            col = rho * col + (1 - rho) * jnp.mean(g2, axis=d1)
            r_mean = jnp.mean(r, axis=d1 - 1 if d1 > d0 else d1, keepdims=True)    # d1's axis in r (d0 removed)
            u = g * jnp.expand_dims(jax.lax.rsqrt(r / r_mean), d0) * jnp.expand_dims(jax.lax.rsqrt(col), d1)
            moments = {"v_row": r, "v_col": col}
        u = u / jnp.maximum(1, _rms(u) / c(self.clipping_threshold))
        u = u * c(self.lr)
        if self.multiply_by_parameter_scale:
            u = u * jnp.maximum(_rms(x), c(self.min_scale))
        if self.momentum is not None:
            beta = c(self.momentum)
            (m,) = load(x, state["m"])
            u = moments["m"] = beta * m + (1 - beta) * u
        # moments are computed unrounded and rounded only to be stored (their dtype at init)
        new = {k: store((a,), (state[k],))[0] for k, a in moments.items()}
        return {"count": count, **new}, u + c(self.weight_decay) * x


def _rms(a: jax.Array) -> jax.Array:
    """The root mean square of all entries of `a`, in at least float32."""
    return jnp.sqrt(jnp.mean(abs2(a.astype(jnp.promote_types(a.dtype, jnp.float32)))))
