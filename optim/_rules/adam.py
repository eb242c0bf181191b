"""The Adam family: `Adam`, `RAdam`, `AdaMax`, `OAdam`, `AMSGrad`, `NAdam`, `AdamW`, `AdaBelief`.

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from .._base.export import register_for_export
from .fields import Small, flag, nonneg, static, unit
from .moments import bt_init, bt_next, debias, load, moments, mu_zeros, nu_zeros, StateDtypes, store
from .schedules import Hyper
from .protocol import Rule, abs2, eps_of, pair_of, zeros_real, as_compute

__all__ = ["Adam", "RAdam", "AdaMax", "OAdam", "AMSGrad", "NAdam", "AdamW", "AdaBelief"]


# Named per-parameter states: `state["w"].state.mu` reads as the docstrings do, and `state_dict` keys by name.
# They flatten like the tuples they replaced (same leaves, same order), so stacking, vmap and old files agree.
@register_for_export
class AdamState(NamedTuple):
    """The state of Adam, AdamW, NAdam and Lamb."""
    mu: Any              # first moment
    nu: Any              # second moment
    bt: Small            # products (∏β₁, ∏β₂) of the steps taken, for the bias correction


@register_for_export
class RAdamState(NamedTuple):
    mu: Any
    nu: Any
    bt: Small
    t: Small             # the step number, int32


@register_for_export
class AdaMaxState(NamedTuple):
    mu: Any
    u: Any               # exponentially weighted infinity norm
    bt: Small


@register_for_export
class OAdamState(NamedTuple):
    mu: Any
    nu: Any
    bt: Small
    term: Any            # the previous step's term, T_prev


@register_for_export
class AMSGradState(NamedTuple):
    mu: Any
    nu: Any
    nu_max: Any          # the running maximum of the second moment


@register_for_export
class AdaBeliefState(NamedTuple):
    mu: Any
    s: Any               # the "belief" second moment of g - m
    bt: Small


class Adam(StateDtypes, Rule):
    """Adam: `m ← β₁ m + (1 - β₁) g`, `v ← β₂ v + (1 - β₂)|g|²`, `step = η m̂ / (√v̂ + ε)`.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂) of the moments, default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim.Quantized` for 8- and 4-bit formats.
        nu_dtype: storage dtype of `v`, default None (the parameter's real dtype); structural.

    State: `AdamState(mu, nu, bt)`: first moment (`mu_dtype`, default the parameter dtype), second moment (`nu_dtype`,
    default the real dtype), both starting at 0, and the products (β₁ᵗ, β₂ᵗ) of the decay rates of the steps
    taken (1 at the start) as one array of 2.

    Reference: D. P. Kingma, J. Ba, "Adam: A Method for Stochastic Optimization", 2014,
    https://arxiv.org/abs/1412.6980

    optax: same as `optax.adam(η, b1, b2, eps)` (to float32 rounding: here `1 - β` is computed from β in the
    compute dtype, optax rounds the Python number, a relative difference of ~1e-5 in `v`).
    `Adam(η, mu_dtype=d)` stores `m` in `d` like `optax.adam(η, mu_dtype=d)` but computes `β₁ m` from the stored
    `m` in float32, where optax, given β as Python floats (its default), multiplies in `d`: a bfloat16 `β₁ m`,
    rounded before the float32 sum, so its bfloat16 moments drift from these by a few bfloat16 ulp (given β as
    float32 arrays, optax rounds where optim does, and the stored moments are equal). optax has no `nu_dtype`:
    its `v` keeps the parameter's dtype. The step is computed from the new moments before they are rounded to
    their storage dtype, and optax's rounding of `β₁ m` before the sum is not reproduced (it moved the parameters
    further from float32 Adam's: `bench/NOTES.md`, "bfloat16 moments and rounding").

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.Adam(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x              # the first step is η sign(g): m̂ = g and v̂ = g²
    Array([0.9, 2.1], dtype=float32)
    """

    _formula = "adam"
    lr: Hyper = nonneg(0.001)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    eps: Hyper = nonneg(1e-8)
    mu_dtype: Any = static(None)
    nu_dtype: Any = static(None)

    def init(self, x):
        return AdamState(mu_zeros(self, x), nu_zeros(self, x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        bt = bt_next(state[2], self.beta, x)      # this step's β multiplied in first (see moments.bt_init)
        m, v = moments(self.beta, *load(x, *state[:2]), dx, x)
        c1, c2 = debias(bt)
        step = m * c1 / (jnp.sqrt(v * c2) + eps_of(self.eps, x)) * as_compute(self.lr, x)
        return AdamState(*store((m, v), state), bt), step


def rectification(b2, t, b2t):
    """RAdam's rectification at step `t` (from 1) with `b2t` = β₂ᵗ: `(r, ρ > 4)`, where ρ∞ = 2 / (1 - β₂) - 1,
    ρ = ρ∞ - 2 t β₂ᵗ / (1 - β₂ᵗ) and r = √((ρ - 4)(ρ - 2) ρ∞ / ((ρ∞ - 4)(ρ∞ - 2) ρ)) (0 where that is negative).
    Also what the fused CPU kernel is given per parameter (`optim._engine.fused_kinds`)."""
    rho_inf = 2 / (1 - b2) - 1
    rho = rho_inf - 2 * t.astype(b2.dtype) * b2t / (1 - b2t)
    r = jnp.sqrt(jnp.maximum((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho), 0))
    return r, rho > 4


class RAdam(StateDtypes, Rule):
    """Rectified Adam: with `ρ∞ = 2/(1 - β₂) - 1` and `ρ = ρ∞ - 2t bt₂/(1 - bt₂)`, `step = η r m̂ / (√v̂ + ε)`
    when `ρ > 4` (`r = √((ρ-4)(ρ-2)ρ∞ / ((ρ∞-4)(ρ∞-2)ρ))`), else `η m̂` (momentum SGD while the variance of
    the adaptive rate is intractable).

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim.Quantized` for 8- and 4-bit formats.
        nu_dtype: storage dtype of `v`, default None (the parameter's real dtype); structural.

    State: `RAdamState(mu, nu, bt, t)`: first moment, second moment, products (β₁ᵗ, β₂ᵗ) (as `Adam`) and the
    number `t` of the next step (int32, starting at 1).

    Reference: L. Liu, H. Jiang, P. He, W. Chen, X. Liu, J. Gao, J. Han, "On the Variance of the Adaptive
    Learning Rate and Beyond", 2019, https://arxiv.org/abs/1908.03265

    optax: equals `optax.radam(η, b1, b2, eps, threshold=4.0)`; optax tests ρ ≥ threshold with a default of 5.
    In float32 the two drift apart by about 1e-5 relative over 100 steps, from the rounding of `1 - β` (see
    `Adam`); in float64 they agree to 1e-14. `optax.radam` has no `mu_dtype` / `nu_dtype`.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.RAdam(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x              # early steps are η m̂
    Array([0.95, 2.1 ], dtype=float32)
    """

    _formula = "radam"
    lr: Hyper = nonneg(0.001)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    eps: Hyper = nonneg(1e-8)
    mu_dtype: Any = static(None)
    nu_dtype: Any = static(None)

    def init(self, x):
        return RAdamState(mu_zeros(self, x), nu_zeros(self, x), bt_init(self.beta, x), jnp.ones((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        bt, t = bt_next(state[2], self.beta, x), state[3]
        m, v = moments(self.beta, *load(x, *state[:2]), dx, x)
        r, rectified = rectification(as_compute(self.beta[1], x), t, bt[1])
        c1, c2 = debias(bt)
        lr, mhat = as_compute(self.lr, x), m * c1
        step = jnp.where(rectified, mhat * r / (jnp.sqrt(v * c2) + eps_of(self.eps, x)) * lr, mhat * lr)
        return RAdamState(*store((m, v), state), bt, t + 1), step


class AdaMax(Rule):
    """AdaMax, Adam with the infinity norm: `m ← β₁ m + (1 - β₁) g`, `u ← max(β₂ u, |g|)`,
    `step = (η / (1 - bt₁)) m / (u + ε)`.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).

    State: `AdaMaxState(mu, u, bt)`: first moment (parameter dtype), exponentially weighted infinity norm (real
    dtype), both starting at 0, and the products (β₁ᵗ, β₂ᵗ).

    Reference: D. P. Kingma, J. Ba, "Adam: A Method for Stochastic Optimization" (section 7), 2014,
    https://arxiv.org/abs/1412.6980

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.AdaMax(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.9, 2.1], dtype=float32)
    """

    lr: Hyper = nonneg(0.001)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    eps: Hyper = nonneg(1e-8)

    def init(self, x):
        return AdaMaxState(jnp.zeros_like(x), zeros_real(x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        m, u, bt = state
        bt = bt_next(bt, self.beta, x)
        b1, b2 = pair_of(self.beta, x)
        m = b1 * m + (1 - b1) * dx
        u = jnp.maximum(b2 * u, jnp.abs(dx))
        step = (as_compute(self.lr, x) / (1 - bt[0])) * m / (u + eps_of(self.eps, x))
        return AdaMaxState(m, u, bt), step


class OAdam(Rule):
    """Optimistic Adam: with the Adam step `T = η m̂ / (√v̂ + ε)`, `step = 2T - T_prev`.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.5, 0.9), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).

    State: `OAdamState(mu, nu, bt, term)`: first moment, second moment, products (β₁ᵗ, β₂ᵗ) (as `Adam`) and the
    previous Adam step `T` (parameter dtype, starting at 0).

    Reference: C. Daskalakis, A. Ilyas, V. Syrgkanis, H. Zeng, "Training GANs with Optimism", 2017,
    https://arxiv.org/abs/1711.00141

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.OAdam(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x              # 2T - 0 with T = η sign(g)
    Array([0.8, 2.2], dtype=float32)
    """

    lr: Hyper = nonneg(0.001)
    beta: tuple[Hyper, Hyper] = unit((0.5, 0.9))
    eps: Hyper = nonneg(1e-8)

    def init(self, x):
        return OAdamState(jnp.zeros_like(x), zeros_real(x), bt_init(self.beta, x), jnp.zeros_like(x))

    def apply(self, state, x, dx, *dxs):
        m, v, bt, prev = state
        bt = bt_next(bt, self.beta, x)
        m, v = moments(self.beta, m, v, dx, x)
        c1, c2 = debias(bt)
        term = as_compute(self.lr, x) * m * c1 / (jnp.sqrt(v * c2) + eps_of(self.eps, x))
        return OAdamState(m, v, bt, term), 2 * term - prev


class AMSGrad(StateDtypes, Rule):
    """AMSGrad (no bias correction): `m`, `v` as in Adam, `v̂ ← max(v̂, v)`, `step = η m / (√v̂ + ε)`;
    `m`, `v`, `v̂` start at ε.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim.Quantized` for 8- and 4-bit formats.
        nu_dtype: storage dtype of `v` and `v̂`, default None (the parameter's real dtype); structural.

    State: `AMSGradState(mu, nu, nu_max)`: first moment (`mu_dtype`, default the parameter dtype), second moment and
    its running maximum (`nu_dtype`, default the real dtype), all starting at ε.

    Reference: S. J. Reddi, S. Kale, S. Kumar, "On the Convergence of Adam and Beyond", ICLR 2018,
    https://arxiv.org/abs/1904.09237

    optax: equals `optax.amsgrad(η, b1, b2, eps, bias_correction_mu=False, bias_correction_nu=False)` with its
    moments started at ε; optax starts them at 0 and bias-corrects by default. In float32 the two drift apart by
    about 3e-6 relative over 100 steps, from the rounding of `1 - β` (see `Adam`). optax's `mu_dtype` is
    `mu_dtype` here; it has no `nu_dtype`.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.AMSGrad(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x.round(4)     # without bias correction: η (1 - β₁) g / √((1 - β₂) g²)
    Array([0.6838, 2.3162], dtype=float32)
    """

    _formula = "amsgrad"
    lr: Hyper = nonneg(0.001)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    eps: Hyper = nonneg(1e-8)
    mu_dtype: Any = static(None)
    nu_dtype: Any = static(None)

    def init(self, x):
        e = as_compute(self.eps, x)
        return AMSGradState(mu_zeros(self, x, e), nu_zeros(self, x, e), nu_zeros(self, x, e))

    def apply(self, state, x, dx, *dxs):
        m, v, vmax = load(x, *state)
        m, v = moments(self.beta, m, v, dx, x)
        vmax = jnp.maximum(vmax, v)
        step = as_compute(self.lr, x) * m / (jnp.sqrt(vmax) + eps_of(self.eps, x))
        return AMSGradState(*store((m, v, vmax), state)), step


def nadam_factors(b1, b2, bt):
    """NAdam's factors of m, of g and of v with `bt` = (β₁ᵗ, β₂ᵗ): `(β₁ / (1 - β₁ β₁ᵗ), (1 - β₁) / (1 - β₁ᵗ),
    β₂ / (1 - β₂ᵗ))`. Factors, not divisions: per-parameter numbers (see `debias`), also what the fused CPU kernel
    is given per parameter (`optim._engine.fused_kinds`)."""
    return b1 / (1 - b1 * bt[0]), (1 - b1) / (1 - bt[0]), b2 / (1 - bt[1])


class NAdam(StateDtypes, Rule):
    """Nesterov Adam: `m`, `v` as in Adam, then
    `step = η (β₁ m / (1 - β₁ bt₁) + (1 - β₁) g / (1 - bt₁)) / (√(β₂ v / (1 - bt₂)) + ε)`.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim.Quantized` for 8- and 4-bit formats.
        nu_dtype: storage dtype of `v`, default None (the parameter's real dtype); structural.

    State: `AdamState(mu, nu, bt)`: first moment, second moment, products (β₁ᵗ, β₂ᵗ) (as `Adam`).

    Reference: T. Dozat, "Incorporating Nesterov Momentum into Adam", ICLR 2016 workshop,
    https://openreview.net/forum?id=OM0jvwB8jIp57ZJjtNEZ

    optax: `optax.nadam` omits Dozat's β₂ inside the root; `NAdam(η, β, ε)` equals
    `optax.nadam(η / √β₂, β₁, β₂, eps=ε / √β₂)`; optax's `mu_dtype` is `mu_dtype` here, it has no `nu_dtype`.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.NAdam(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x.round(4)
    Array([0.8526, 2.1474], dtype=float32)
    """

    _formula = "nadam"
    lr: Hyper = nonneg(0.001)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    eps: Hyper = nonneg(1e-8)
    mu_dtype: Any = static(None)
    nu_dtype: Any = static(None)

    def init(self, x):
        return AdamState(mu_zeros(self, x), nu_zeros(self, x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        bt = bt_next(state[2], self.beta, x)
        b1, b2 = pair_of(self.beta, x)
        m, v = moments(self.beta, *load(x, *state[:2]), dx, x)
        cm, cg, cv = nadam_factors(b1, b2, bt)
        step = (m * cm + dx * cg) / (jnp.sqrt(v * cv) + eps_of(self.eps, x)) * as_compute(self.lr, x)
        return AdamState(*store((m, v), state), bt), step


class AdamW(StateDtypes, Rule):
    """Adam with decoupled weight decay. With `A` the Adam step at η = 1:
    `step = η (A + λ x)` (`couple=True`, PyTorch's convention) or `η A + λ x` (`couple=False`). λ defaults to 0.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        weight_decay: λ, default 0.0, >= 0.
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        couple: whether the decay is scaled by η, default True (structural).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim.Quantized` for 8- and 4-bit formats.
        nu_dtype: storage dtype of `v`, default None (the parameter's real dtype); structural.

    State: `AdamState(mu, nu, bt)`: first moment, second moment, products (β₁ᵗ, β₂ᵗ) (as `Adam`).

    Reference: I. Loshchilov, F. Hutter, "Decoupled Weight Decay Regularization", 2017,
    https://arxiv.org/abs/1711.05101

    optax: `couple=True` equals `optax.adamw(η, b1, b2, eps, weight_decay=λ)` (optax's default λ is 1e-4);
    optax's `mu_dtype` is `mu_dtype` here, it has no `nu_dtype`.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.AdamW(0.1, weight_decay=0.5), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x              # η (sign(g) + λ x)
    Array([0.85, 2.  ], dtype=float32)
    """

    _formula = "adamw"
    lr: Hyper = nonneg(0.001)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    weight_decay: Hyper = nonneg(0.0)
    eps: Hyper = nonneg(1e-8)
    couple: bool = flag(True)
    mu_dtype: Any = static(None)
    nu_dtype: Any = static(None)

    def init(self, x):
        return AdamState(mu_zeros(self, x), nu_zeros(self, x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        bt = bt_next(state[2], self.beta, x)
        m, v = moments(self.beta, *load(x, *state[:2]), dx, x)
        # Optimisers.jl: the inner Adam uses the raw ε, floored like every other rule for 16-bit floats here.
        c1, c2 = debias(bt)
        a = m * c1 / (jnp.sqrt(v * c2) + eps_of(self.eps, x))
        lr, wd = as_compute(self.lr, x), as_compute(self.weight_decay, x)
        step = lr * (a + wd * x) if self.couple else lr * a + wd * x
        return AdamState(*store((m, v), state), bt), step


class AdaBelief(StateDtypes, Rule):
    """AdaBelief: `m ← β₁ m + (1 - β₁) g`, `s ← β₂ s + (1 - β₂)|g - m|² + ε`,
    `step = η m̂ / (√(s / (1 - bt₂)) + ε)`.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-16, >= 0 (at least 1e-7 for 16-bit parameters).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim.Quantized` for 8- and 4-bit formats.
        nu_dtype: storage dtype of `s`, default None (the parameter's real dtype); structural.

    State: `AdaBeliefState(mu, s, bt)`: first moment (`mu_dtype`, default the parameter dtype), the "belief" second
    moment of `g - m` (`nu_dtype`, default the real dtype), both starting at 0, and the products (β₁ᵗ, β₂ᵗ).

    Reference: J. Zhuang, T. Tang, Y. Ding, S. Tatikonda, N. Dvornek, X. Papademetris, J. Duncan, "AdaBelief
    Optimizer: Adapting Stepsizes by the Belief in Observed Gradients", 2020, https://arxiv.org/abs/2010.07468

    optax: equals `optax.adabelief(η, b1, b2, eps=ε, eps_root=ε)`; `optax.adabelief` has no `mu_dtype`.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.AdaBelief(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x.round(4)
    Array([0.8889, 2.1111], dtype=float32)
    """

    _formula = "adabelief"
    lr: Hyper = nonneg(0.001)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    eps: Hyper = nonneg(1e-16)
    mu_dtype: Any = static(None)
    nu_dtype: Any = static(None)

    def init(self, x):
        return AdaBeliefState(mu_zeros(self, x), nu_zeros(self, x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        (m, s), bt = load(x, *state[:2]), bt_next(state[2], self.beta, x)
        b1, b2 = pair_of(self.beta, x)
        eps = eps_of(self.eps, x)
        m = b1 * m + (1 - b1) * dx
        s = b2 * s + (1 - b2) * abs2(dx - m) + eps
        c1, c2 = debias(bt)
        step = as_compute(self.lr, x) * m * c1 / (jnp.sqrt(s * c2) + eps)
        return AdaBeliefState(*store((m, s), state), bt), step
