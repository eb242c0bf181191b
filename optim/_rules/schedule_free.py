"""Schedule-free training: `ScheduleFreeAdamW`, whose evaluation point `optim.averaged` returns."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from .._base.export import register_for_export
from .fields import Small, nonneg, unit
from .hyper import is_concrete, is_schedule
from .schedules import Hyper
from .protocol import Rule, abs2, compute_dtype, eps_of, pair_of, zeros_real, as_compute

__all__ = ["ScheduleFreeAdamW"]


@register_for_export
class ScheduleFreeState(NamedTuple):
    z: Any               # the base sequence
    nu: Any              # the second moment
    t: Small             # the number of the next step, int32
    a: Small             # (S, η_max, β₁'): the averaging sum, the largest warmed-up η, the β₁ that built y


class ScheduleFreeAdamW(Rule):
    """Schedule-Free AdamW (Defazio et al. 2024): no momentum and no decaying schedule; the parameter the model
    is trained at is the interpolation `y = β₁ x + (1 - β₁) z` of a base sequence `z`, which takes AdamW's
    steps without momentum, and its weighted average `x`, the point to evaluate at (`optim.averaged`). Step
    `t` (1 on a parameter's first step), with `y` the current parameter:

    - `v ← β₂ v + (1 - β₂)|g|²`, `z ← z - η_z (g / (√(v / (1 - β₂ᵗ)) + ε) + λ y)` (decay at `y`);
    - `x_prev = (y - (1 - β₁') z_prev) / β₁'` (β₁' the β₁ that built `y`), `η_max ← max(η_max, η_w)`,
      `w = η_maxᵏ`, `S ← S + w`, `c = w / S` (0 while `S = 0`), `x = (1 - c) x_prev + c z`;
    - the new parameter is `y = β₁ x + (1 - β₁) z`.

    Warmup: `η_z = η min(t - 1, W) / W` and `η_w = η min(t, W) / W` (both `η` when `W = 0`), as optax, whose
    two schedule counters are one apart (the first z step is 0 during warmup).

    Counts are per parameter: a parameter with no step (a `None` gradient, frozen) keeps its `t`, warmup,
    averaging weights and moments. A tie group is one parameter (tie-summed gradient).

    Args:
        lr: learning rate η (the peak, after warmup), default 0.0025, >= 0.
        beta: (β₁, β₂): the interpolation weight of `y` and the decay of the second moment, default
            (0.9, 0.999); β₁ in (0, 1) (0 would make `x` unrecoverable), β₂ in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        weight_decay: λ, scaled by `η_z` (PyTorch's convention), default 0.0, >= 0.
        warmup_steps: W, the length of the linear warmup of η from 0, default 0.0 (none), >= 0.
        weight_lr_power: k, the power of `η_max` in the averaging weights, default 2.0, >= 0.

    All are adjustable (`optim.adjust`); a changed β₁ is safe: `x` is recovered with the β₁ stored in the
    state and `y` rebuilt with the new one.

    State: `ScheduleFreeState(z, nu, t, a)`: the base sequence `z` (starting at the parameter; its dtype, or float32
    if that is wider), the second moment `v` (real dtype, starting at 0), the number `t` of the next step (int32,
    starting at 1) and `a = (S, η_max, β₁')` (compute dtype, starting at (0, 0, 1)).

    Reference: A. Defazio, X. A. Yang, H. Mehta, K. Mishchenko, A. Khaled, A. Cutkosky, "The Road Less
    Scheduled", 2024, https://arxiv.org/abs/2405.15682

    optax: the parameters equal those of `optax.contrib.schedule_free_adamw(η, warmup_steps=W or None, b1=β₁,
    b2=β₂, eps=ε, weight_decay=λ, weight_lr_power=k)` (the defaults are optax's) and
    `optim.averaged(state, model)` equals `optax.contrib.schedule_free_eval_params(opt_state, params)`; in
    float32 to about 1e-6 relative over 100 steps, from the rounding of `1 - β` (see `Adam`).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.ScheduleFreeAdamW(0.1), x)
    >>> for _ in range(2):
    ...     state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> # z: 0.9 then 0.8; x = (0.9 + 0.8) / 2; y = 0.9 x + 0.1 z
    >>> avg = optim.averaged(state, x)
    >>> [round(float(v), 4) for v in x], [round(float(v), 4) for v in avg]
    ([0.845, 2.155], [0.85, 2.15])
    """

    lr: Hyper = nonneg(0.0025)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    eps: Hyper = nonneg(1e-8)
    weight_decay: Hyper = nonneg(0.0)
    warmup_steps: Hyper = nonneg(0.0)
    weight_lr_power: Hyper = nonneg(2.0)

    @classmethod
    def _checked(cls, name, v):
        v = super()._checked(name, v)
        if name == "beta" and _is_zero(v[0]):
            raise ValueError(f"{cls.__name__}: beta[0] must be in (0, 1) and finite, got 0.0 "
                             "(the averaged x is recovered by dividing by it)")
        return v

    def init(self, x):
        z = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        a = jnp.asarray([0.0, 0.0, 1.0], compute_dtype(x))
        return ScheduleFreeState(z, zeros_real(x), jnp.ones((), jnp.int32), a)

    def apply(self, state, x, dx, *dxs):
        z, v, t, a = state
        b1, b2 = pair_of(self.beta, x)
        lr, warm = as_compute(self.lr, x), as_compute(self.warmup_steps, x)
        tf = t.astype(lr.dtype)

        def ramp(k):   # optax's warmup_constant_schedule(0, η, W) at count k, as a factor of η
            return jnp.where(warm > 0, jnp.minimum(k, warm) / jnp.where(warm > 0, warm, 1), 1)

        v = b2 * v + (1 - b2) * abs2(dx)
        u = dx / (jnp.sqrt(v / (1 - b2 ** tf)) + eps_of(self.eps, x)) + as_compute(self.weight_decay, x) * x
        z_new = z - (lr * ramp(tf - 1)) * u
        lr_max = jnp.maximum(a[1], lr * ramp(tf))
        w = lr_max ** as_compute(self.weight_lr_power, x)
        total = a[0] + w
        c = jnp.where(total == 0, 0, w / jnp.where(total == 0, 1, total))
        x_prev = (x - (1 - a[2]) * z) / a[2]
        avg = (1 - c) * x_prev + c * z_new
        y = b1 * avg + (1 - b1) * z_new
        return ScheduleFreeState(z_new, v, t + 1, jnp.stack([total, lr_max, b1])), x - y

    def average(self, state, x):
        z, _, _, a = state
        return ((x - (1 - a[2]) * z) / a[2]).astype(x.dtype)


def _is_zero(v) -> bool:
    """A concrete number equal to 0 (False for schedules and tracers, which are not checked here)."""
    return is_concrete(v) and not is_schedule(v) and bool(np.all(np.asarray(v, np.float64) == 0))
