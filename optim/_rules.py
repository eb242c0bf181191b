"""Per-leaf rules: pure `init(x) -> state` and `apply(state, x, dx, *dxs) -> (state, step)` over one parameter.

The new parameter is `x - step` (the protocol is in `optim._step`). Formulas and defaults follow Optimisers.jl
v0.4 (Lion follows its paper). Muon, Lamb and Lars are in `optim._layerwise`, Adafactor in `optim._adafactor`,
ScheduleFreeAdamW in `optim._schedule_free` (they follow optax).
Notation in the docstrings: `g` is the gradient, `η` the learning rate, `t` the step number (1 on the first
step), `bt` the running powers `(β₁ᵗ, β₂ᵗ)` (they start at `(β₁, β₂)`), `m̂ = m / (1 - bt₁)` and
`v̂ = v / (1 - bt₂)`. Hyperparameters are numbers, arrays or schedules (`Hyper`);
ranges are checked when a rule is built and when `adjust` changes them.

Gradients reach `apply` already summed over a tie group, cast to the parameter's dtype and, for complex
parameters, conjugated: JAX's gradient of a real loss w.r.t. a complex `w` is the conjugate of the steepest
descent direction, so after conjugation `x - η g` descends, as in Optimisers.jl and PyTorch. Rules compute in
the parameter's real dtype but at least float32 (`optim._step.compute_dtype`); states keep their storage dtype.

States are named tuples (`AdamState(mu, nu, bt)`: `state["w"].state.mu`), which index like the plain tuples
of earlier versions (files written by `optim.save` then still load). Moment storage dtypes (`mu_dtype`,
`nu_dtype`) are described in `optim._moments`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ._export import register_for_export
from ._moments import bt_init, bt_next, debias, load, moments, mu_zeros, nu_zeros, StateDtypes, store
from ._schedules import Hyper
from ._step import Rule, abs2, eps_of, pair_of, real_dtype, zeros_real, as_compute, clip_factor, where

__all__ = [
    "Descent", "Momentum", "Nesterov", "Rprop", "RMSProp", "Adam", "RAdam", "AdaMax", "OAdam", "AdaGrad",
    "AdaDelta", "AMSGrad", "NAdam", "AdamW", "AdaBelief", "Lion", "WeightDecay", "SignDecay", "ClipGrad",
    "ClipNorm", "Scale",
]


# ----------------------------------------------------------------------------------------------- states
# Named per-parameter states: `state["w"].state.mu` reads as the docstrings do, and `state_dict` keys by name.
# They flatten like the tuples they replaced (same leaves, same order), so stacking, vmap and old files agree.
@register_for_export
class RpropState(NamedTuple):
    g_prev: Any          # the previous gradient (0 after a sign flip)
    eta: Any             # the per-element step sizes


@register_for_export
class RMSPropState(NamedTuple):
    quad: Any            # running mean of |g|²
    lin: Any             # running mean of g (centred), else None


@register_for_export
class AdamState(NamedTuple):
    """The state of Adam, AdamW, NAdam and Lamb."""
    mu: Any              # first moment
    nu: Any              # second moment
    bt: Any              # running powers (β₁ᵗ, β₂ᵗ) of the bias correction


@register_for_export
class RAdamState(NamedTuple):
    mu: Any
    nu: Any
    bt: Any
    t: Any               # the step number, int32


@register_for_export
class AdaMaxState(NamedTuple):
    mu: Any
    u: Any               # exponentially weighted infinity norm
    bt: Any


@register_for_export
class OAdamState(NamedTuple):
    mu: Any
    nu: Any
    bt: Any
    term: Any            # the previous step's term, T_prev


@register_for_export
class AdaDeltaState(NamedTuple):
    acc_grad: Any        # running mean of |g|²
    acc_step: Any        # running mean of |step|²


@register_for_export
class AMSGradState(NamedTuple):
    mu: Any
    nu: Any
    nu_max: Any          # the running maximum of the second moment


@register_for_export
class AdaBeliefState(NamedTuple):
    mu: Any
    s: Any               # the "belief" second moment of g - m
    bt: Any


# ----------------------------------------------------------------------------------------------- SGD family
class Descent(Rule):
    """Plain gradient descent: `step = η g`.

    Args:
        lr: learning rate η, default 0.1, >= 0.

    State: none (`None`).

    optax: same as `optax.sgd(η)`.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.Descent(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.95, 2.1 ], dtype=float32)
    """

    _formula = "descent"
    lr: Hyper = 0.1
    _nonneg = ("lr",)

    def apply(self, state, x, dx, *dxs):
        return state, as_compute(self.lr, x) * dx


class Momentum(StateDtypes, Rule):
    """Gradient descent with (heavy-ball) momentum: `v ← ρ v + η g`, `step = v`.

    Args:
        lr: learning rate η, default 0.01, >= 0.
        rho: momentum ρ, default 0.9, in [0, 1].
        mu_dtype: storage dtype of `v`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim._moments`.

    State: `v`, the velocity (the last step), in `mu_dtype` (default the parameter's dtype), starting at 0.

    Reference: B. T. Polyak, "Some methods of speeding up the convergence of iteration methods", USSR
    Computational Mathematics and Mathematical Physics, 1964, https://doi.org/10.1016/0041-5553(64)90137-5

    optax: the same steps as `optax.sgd(η, momentum=ρ)` while η is constant; optax keeps `t ← ρt + g` and
    scales by the current η, here `v` accumulates `η g`, so a changed η (adjust, schedule) affects new gradients.
    optax's `accumulator_dtype` is its trace's storage dtype, as `mu_dtype` here.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.Momentum(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x, state[""].state
    (Array([0.95, 2.1 ], dtype=float32), Array([ 0.05, -0.1 ], dtype=float32))
    """

    _formula = "momentum"
    lr: Hyper = 0.01
    rho: Hyper = 0.9
    mu_dtype: Any = None
    _static = ("mu_dtype",)
    _nonneg = ("lr",)
    _decay = ("rho",)

    def init(self, x):
        return mu_zeros(self, x)

    def apply(self, v0, x, dx, *dxs):
        (v,) = load(x, v0)
        v = as_compute(self.rho, x) * v + as_compute(self.lr, x) * dx
        return v.astype(v0.dtype), v


class Nesterov(Rule):
    """Nesterov momentum (PyTorch's `nesterov=True`): `step = -ρ² v + (1 + ρ) η g`, then `v ← ρ v - η g`.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        rho: momentum ρ, default 0.9, in [0, 1].

    State: `v`, minus the momentum buffer (`v ← ρ v - η g`), in the parameter's dtype, starting at 0.

    Reference: I. Sutskever, J. Martens, G. Dahl, G. Hinton, "On the importance of initialization and momentum
    in deep learning", ICML 2013, https://proceedings.mlr.press/v28/sutskever13.html (after Y. Nesterov, 1983).

    optax: the same as `optax.sgd(η, momentum=ρ, nesterov=True)` while η is constant (see `Momentum`).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.Nesterov(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.905, 2.19 ], dtype=float32)
    """

    lr: Hyper = 0.001
    rho: Hyper = 0.9
    _nonneg = ("lr",)
    _decay = ("rho",)

    def init(self, x):
        return jnp.zeros_like(x)

    def apply(self, v, x, dx, *dxs):
        lr, rho = as_compute(self.lr, x), as_compute(self.rho, x)
        step = -(rho * rho) * v + (1 + rho) * lr * dx
        return rho * v - lr * dx, step


class Rprop(Rule):
    """Resilient backprop: per-element step sizes that grow while the gradient keeps its sign and shrink when it
    flips. With `s = g_prev · g`: `η ← min(η ell₁, gamma₁)` where `s > 0`, `η ← max(η ell₀, gamma₀)` where
    `s < 0`, unchanged where `s = 0`; then `g_prev ← 0` where `s < 0` (no step after a flip), else `g`;
    `step = η ⊙ sign(g_prev)`. Real parameters only (a complex one is a `TypeError` at `setup`).

    Args:
        lr: initial step size η of every element, default 1e-3, >= 0.
        ell: `(shrink, grow)` factors (η⁻, η⁺), default (0.5, 1.2), each >= 0.
        gamma: `(min, max)` bounds of the step sizes (Γ_min, Γ_max), default (1e-6, 50.0), each >= 0.

    State: `RpropState(g_prev, eta)`: the previous gradient (0 after a sign flip), starting at 0, and the
    per-element step sizes, starting at `lr`; both in the parameter's dtype.

    Reference: M. Riedmiller, H. Braun, "A direct adaptive method for faster backpropagation learning: the
    RPROP algorithm", IEEE International Conference on Neural Networks, 1993,
    https://doi.org/10.1109/ICNN.1993.298623

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.Rprop(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.9, 2.1], dtype=float32)
    """

    lr: Hyper = 1e-3
    ell: tuple[Hyper, Hyper] = (0.5, 1.2)
    gamma: tuple[Hyper, Hyper] = (1e-6, 50.0)
    _nonneg = ("lr", "ell", "gamma")

    def init(self, x):
        if jnp.iscomplexobj(x):
            raise TypeError("Rprop needs real parameters (it compares gradient signs)")
        return RpropState(jnp.zeros_like(x), jnp.full_like(x, as_compute(self.lr, x)))

    def apply(self, state, x, dx, *dxs):
        gp, eta = state
        (lo, hi), (gmin, gmax) = pair_of(self.ell, x), pair_of(self.gamma, x)
        s = gp * dx
        # `where`: the state (s) may be split where the gradient is not (ZeRO-1 on Explicit mesh axes)
        eta = where(s > 0, jnp.minimum(eta * hi, gmax), where(s < 0, jnp.maximum(eta * lo, gmin), eta))
        gp = where(s < 0, jnp.zeros_like(dx), dx)
        return RpropState(gp, eta), eta * jnp.sign(gp)


# ----------------------------------------------------------------------------------------------- adaptive
class RMSProp(Rule):
    """RMSProp: `q ← ρ q + (1 - ρ)|g|²`, `step = η g / (√q + ε)`; `centred=True` also tracks `l ← ρ l + (1 - ρ) g`
    and uses `√(q - |l|²)`. ε is outside the square root and ρ defaults to 0.9.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        rho: decay ρ of the running averages, default 0.9, in [0, 1].
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        centred: subtract the squared running mean of `g` (Graves' centred form), default False (structural).

    State: `RMSPropState(quad, lin)`: `q`, the running mean of `|g|²` (real dtype), and when centred `l`, the
    running mean of `g` (else `None`); both start at 0.

    Reference: T. Tieleman, G. Hinton, "Lecture 6.5 — RMSProp: divide the gradient by a running average of its
    recent magnitude", COURSERA: Neural Networks for Machine Learning, 2012,
    https://www.cs.toronto.edu/~tijmen/csc321/slides/lecture_slides_lec6.pdf. Centred: A. Graves, "Generating
    Sequences With Recurrent Neural Networks", 2013, https://arxiv.org/abs/1308.0850

    optax: equals `optax.rmsprop(η, decay=ρ, eps=ε, eps_in_sqrt=False)` (centred: `centered=True`); optax's
    default puts ε inside the square root.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.RMSProp(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x.round(4)     # the first step is η sign(g) / √(1 - ρ)
    Array([0.6838, 2.3162], dtype=float32)
    """

    lr: Hyper = 0.001
    rho: Hyper = 0.9
    eps: Hyper = 1e-8
    centred: bool = False
    _static = ("centred",)
    _flags = ("centred",)
    _nonneg = ("lr", "eps")
    _decay = ("rho",)

    def init(self, x):
        return RMSPropState(zeros_real(x), jnp.zeros_like(x) if self.centred else None)

    def apply(self, state, x, dx, *dxs):
        q, l = state
        rho = as_compute(self.rho, x)
        q = rho * q + (1 - rho) * abs2(dx)
        if self.centred:
            l = rho * l + (1 - rho) * dx
            q_eff = q - abs2(l)
        else:
            q_eff = q
        return RMSPropState(q, l), dx * as_compute(self.lr, x) / (jnp.sqrt(q_eff) + eps_of(self.eps, x))




class Adam(StateDtypes, Rule):
    """Adam: `m ← β₁ m + (1 - β₁) g`, `v ← β₂ v + (1 - β₂)|g|²`, `step = η m̂ / (√v̂ + ε)`.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂) of the moments, default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim._moments`.
        nu_dtype: storage dtype of `v`, default None (the parameter's real dtype); structural.

    State: `AdamState(mu, nu, bt)`: first moment (`mu_dtype`, default the parameter dtype), second moment (`nu_dtype`,
    default the real dtype), both starting at 0, and the running powers (β₁ᵗ, β₂ᵗ) as one array of 2.

    Reference: D. P. Kingma, J. Ba, "Adam: A Method for Stochastic Optimization", 2014,
    https://arxiv.org/abs/1412.6980

    optax: same as `optax.adam(η, b1, b2, eps)` (to float32 rounding: here `1 - β` is computed from β in the
    compute dtype, optax rounds the Python number, a relative difference of ~1e-5 in `v`).
    `Adam(η, mu_dtype=d)` stores `m` in `d` like `optax.adam(η, mu_dtype=d)` but computes `β₁ m` from the stored
    `m` in float32, where optax, given β as Python floats (its default), multiplies in `d`: a bfloat16 `β₁ m`,
    rounded before the float32 sum, so its bfloat16 moments drift from these by a few bfloat16 ulp (given β as
    float32 arrays, optax rounds where optim does, and the stored moments are equal). optax has no `nu_dtype`:
    its `v` keeps the parameter's dtype.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.Adam(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x              # the first step is η sign(g): m̂ = g and v̂ = g²
    Array([0.9, 2.1], dtype=float32)
    """

    _formula = "adam"
    lr: Hyper = 0.001
    beta: tuple[Hyper, Hyper] = (0.9, 0.999)
    eps: Hyper = 1e-8
    mu_dtype: Any = None
    nu_dtype: Any = None
    _static = ("mu_dtype", "nu_dtype")
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

    def init(self, x):
        return AdamState(mu_zeros(self, x), nu_zeros(self, x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        bt = state[2]
        m, v = moments(self.beta, *load(x, *state[:2]), dx, x)
        c1, c2 = debias(bt)
        step = m * c1 / (jnp.sqrt(v * c2) + eps_of(self.eps, x)) * as_compute(self.lr, x)
        return AdamState(*store((m, v), state), bt_next(bt, self.beta, x)), step


class RAdam(StateDtypes, Rule):
    """Rectified Adam: with `ρ∞ = 2/(1 - β₂) - 1` and `ρ = ρ∞ - 2t bt₂/(1 - bt₂)`, `step = η r m̂ / (√v̂ + ε)`
    when `ρ > 4` (`r = √((ρ-4)(ρ-2)ρ∞ / ((ρ∞-4)(ρ∞-2)ρ))`), else `η m̂` (momentum SGD while the variance of
    the adaptive rate is intractable).

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim._moments`.
        nu_dtype: storage dtype of `v`, default None (the parameter's real dtype); structural.

    State: `RAdamState(mu, nu, bt, t)`: first moment, second moment, running powers (β₁ᵗ, β₂ᵗ) (as `Adam`) and the
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

    lr: Hyper = 0.001
    beta: tuple[Hyper, Hyper] = (0.9, 0.999)
    eps: Hyper = 1e-8
    mu_dtype: Any = None
    nu_dtype: Any = None
    _static = ("mu_dtype", "nu_dtype")
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

    def init(self, x):
        return RAdamState(mu_zeros(self, x), nu_zeros(self, x), bt_init(self.beta, x), jnp.ones((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        bt, t = state[2:]
        m, v = moments(self.beta, *load(x, *state[:2]), dx, x)
        b2 = as_compute(self.beta[1], x)
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * t.astype(b2.dtype) * bt[1] / (1 - bt[1])
        r = jnp.sqrt(jnp.maximum((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho), 0))
        c1, c2 = debias(bt)
        lr, mhat = as_compute(self.lr, x), m * c1
        step = jnp.where(rho > 4, mhat * r / (jnp.sqrt(v * c2) + eps_of(self.eps, x)) * lr, mhat * lr)
        return RAdamState(*store((m, v), state), bt_next(bt, self.beta, x), t + 1), step


class AdaMax(Rule):
    """AdaMax, Adam with the infinity norm: `m ← β₁ m + (1 - β₁) g`, `u ← max(β₂ u, |g|)`,
    `step = (η / (1 - bt₁)) m / (u + ε)`.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).

    State: `AdaMaxState(mu, u, bt)`: first moment (parameter dtype), exponentially weighted infinity norm (real
    dtype), both starting at 0, and the running powers (β₁ᵗ, β₂ᵗ).

    Reference: D. P. Kingma, J. Ba, "Adam: A Method for Stochastic Optimization" (section 7), 2014,
    https://arxiv.org/abs/1412.6980

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.AdaMax(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.9, 2.1], dtype=float32)
    """

    lr: Hyper = 0.001
    beta: tuple[Hyper, Hyper] = (0.9, 0.999)
    eps: Hyper = 1e-8
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

    def init(self, x):
        return AdaMaxState(jnp.zeros_like(x), zeros_real(x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        m, u, bt = state
        b1, b2 = pair_of(self.beta, x)
        m = b1 * m + (1 - b1) * dx
        u = jnp.maximum(b2 * u, jnp.abs(dx))
        step = (as_compute(self.lr, x) / (1 - bt[0])) * m / (u + eps_of(self.eps, x))
        return AdaMaxState(m, u, bt_next(bt, self.beta, x)), step


class OAdam(Rule):
    """Optimistic Adam: with the Adam step `T = η m̂ / (√v̂ + ε)`, `step = 2T - T_prev`.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.5, 0.9), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).

    State: `OAdamState(mu, nu, bt, term)`: first moment, second moment, running powers (β₁ᵗ, β₂ᵗ) (as `Adam`) and the
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

    lr: Hyper = 0.001
    beta: tuple[Hyper, Hyper] = (0.5, 0.9)
    eps: Hyper = 1e-8
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

    def init(self, x):
        return OAdamState(jnp.zeros_like(x), zeros_real(x), bt_init(self.beta, x), jnp.zeros_like(x))

    def apply(self, state, x, dx, *dxs):
        m, v, bt, prev = state
        m, v = moments(self.beta, m, v, dx, x)
        c1, c2 = debias(bt)
        term = as_compute(self.lr, x) * m * c1 / (jnp.sqrt(v * c2) + eps_of(self.eps, x))
        return OAdamState(m, v, bt_next(bt, self.beta, x), term), 2 * term - prev


class AdaGrad(Rule):
    """AdaGrad: `acc ← acc + |g|²` (starting at ε), `step = η g / (√acc + ε)`.

    Args:
        lr: learning rate η, default 0.1, >= 0.
        eps: ε, the accumulator's start and the denominator's offset, default 1e-8, >= 0 (offset at least 1e-7
            for 16-bit parameters).

    State: `acc`, the sum of `|g|²` (real dtype), starting at ε.

    Reference: J. Duchi, E. Hazan, Y. Singer, "Adaptive Subgradient Methods for Online Learning and Stochastic
    Optimization", JMLR 12, 2011, https://jmlr.org/papers/v12/duchi11a.html

    optax: adds eps inside `rsqrt` and starts the accumulator at 0.1; the closest is
    `optax.adagrad(η, initial_accumulator_value=ε, eps=0)`, which differs by the factor √acc / (√acc + ε).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.AdaGrad(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.9, 2.1], dtype=float32)
    """

    lr: Hyper = 0.1
    eps: Hyper = 1e-8
    _nonneg = ("lr", "eps")

    def init(self, x):
        return jnp.full(x.shape, self.eps, real_dtype(x))

    def apply(self, acc, x, dx, *dxs):
        acc = acc + abs2(dx)
        return acc, dx * as_compute(self.lr, x) / (jnp.sqrt(acc) + eps_of(self.eps, x))


class AdaDelta(Rule):
    """AdaDelta (no learning rate): `a ← ρ a + (1 - ρ)|g|²`, `step = g √(d + ε) / √(a + ε)`,
    then `d ← ρ d + (1 - ρ)|step|²`.

    Args:
        rho: decay ρ of the running averages, default 0.9, in [0, 1].
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).

    State: `AdaDeltaState(acc_grad, acc_step)`: running means of `|g|²` and of `|step|²` (real dtype), both starting
    at 0.

    Reference: M. D. Zeiler, "ADADELTA: An Adaptive Learning Rate Method", 2012,
    https://arxiv.org/abs/1212.5701

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.AdaDelta(), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x.round(5)     # the first steps are small: √ε / √(1 - ρ)
    Array([0.99968, 2.00032], dtype=float32)
    """

    rho: Hyper = 0.9
    eps: Hyper = 1e-8
    _nonneg = ("eps",)
    _decay = ("rho",)

    def init(self, x):
        return AdaDeltaState(zeros_real(x), zeros_real(x))

    def apply(self, state, x, dx, *dxs):
        a, d = state
        rho, eps = as_compute(self.rho, x), eps_of(self.eps, x)
        a = rho * a + (1 - rho) * abs2(dx)
        step = dx * jnp.sqrt(d + eps) / jnp.sqrt(a + eps)
        return AdaDeltaState(a, rho * d + (1 - rho) * abs2(step)), step


class AMSGrad(StateDtypes, Rule):
    """AMSGrad (no bias correction): `m`, `v` as in Adam, `v̂ ← max(v̂, v)`, `step = η m / (√v̂ + ε)`;
    `m`, `v`, `v̂` start at ε.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim._moments`.
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

    lr: Hyper = 0.001
    beta: tuple[Hyper, Hyper] = (0.9, 0.999)
    eps: Hyper = 1e-8
    mu_dtype: Any = None
    nu_dtype: Any = None
    _static = ("mu_dtype", "nu_dtype")
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

    def init(self, x):
        e = as_compute(self.eps, x)
        return AMSGradState(mu_zeros(self, x, e), nu_zeros(self, x, e), nu_zeros(self, x, e))

    def apply(self, state, x, dx, *dxs):
        m, v, vmax = load(x, *state)
        m, v = moments(self.beta, m, v, dx, x)
        vmax = jnp.maximum(vmax, v)
        step = as_compute(self.lr, x) * m / (jnp.sqrt(vmax) + eps_of(self.eps, x))
        return AMSGradState(*store((m, v, vmax), state)), step


class NAdam(StateDtypes, Rule):
    """Nesterov Adam: `m`, `v` as in Adam, then
    `step = η (β₁ m / (1 - β₁ bt₁) + (1 - β₁) g / (1 - bt₁)) / (√(β₂ v / (1 - bt₂)) + ε)`.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim._moments`.
        nu_dtype: storage dtype of `v`, default None (the parameter's real dtype); structural.

    State: `AdamState(mu, nu, bt)`: first moment, second moment, running powers (β₁ᵗ, β₂ᵗ) (as `Adam`).

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

    lr: Hyper = 0.001
    beta: tuple[Hyper, Hyper] = (0.9, 0.999)
    eps: Hyper = 1e-8
    mu_dtype: Any = None
    nu_dtype: Any = None
    _static = ("mu_dtype", "nu_dtype")
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

    def init(self, x):
        return AdamState(mu_zeros(self, x), nu_zeros(self, x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        bt = state[2]
        b1, b2 = pair_of(self.beta, x)
        m, v = moments(self.beta, *load(x, *state[:2]), dx, x)
        # Factors of m and g, not divisions: per-parameter numbers (see `debias`).
        num = m * (b1 / (1 - b1 * bt[0])) + dx * ((1 - b1) / (1 - bt[0]))
        step = num / (jnp.sqrt(v * (b2 / (1 - bt[1]))) + eps_of(self.eps, x)) * as_compute(self.lr, x)
        return AdamState(*store((m, v), state), bt_next(bt, self.beta, x)), step


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
            parameter's dtype); structural. See `optim._moments`.
        nu_dtype: storage dtype of `v`, default None (the parameter's real dtype); structural.

    State: `AdamState(mu, nu, bt)`: first moment, second moment, running powers (β₁ᵗ, β₂ᵗ) (as `Adam`).

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
    lr: Hyper = 0.001
    beta: tuple[Hyper, Hyper] = (0.9, 0.999)
    weight_decay: Hyper = 0.0
    eps: Hyper = 1e-8
    couple: bool = True
    mu_dtype: Any = None
    nu_dtype: Any = None
    _static = ("couple", "mu_dtype", "nu_dtype")
    _flags = ("couple",)
    _nonneg = ("lr", "weight_decay", "eps")
    _unit = ("beta",)

    def init(self, x):
        return AdamState(mu_zeros(self, x), nu_zeros(self, x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        bt = state[2]
        m, v = moments(self.beta, *load(x, *state[:2]), dx, x)
        # Optimisers.jl: the inner Adam uses the raw ε, floored like every other rule for 16-bit floats here.
        c1, c2 = debias(bt)
        a = m * c1 / (jnp.sqrt(v * c2) + eps_of(self.eps, x))
        lr, wd = as_compute(self.lr, x), as_compute(self.weight_decay, x)
        step = lr * (a + wd * x) if self.couple else lr * a + wd * x
        return AdamState(*store((m, v), state), bt_next(bt, self.beta, x)), step


class AdaBelief(StateDtypes, Rule):
    """AdaBelief: `m ← β₁ m + (1 - β₁) g`, `s ← β₂ s + (1 - β₂)|g - m|² + ε`,
    `step = η m̂ / (√(s / (1 - bt₂)) + ε)`.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        beta: decay rates (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        eps: ε, default 1e-16, >= 0 (at least 1e-7 for 16-bit parameters).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim._moments`.
        nu_dtype: storage dtype of `s`, default None (the parameter's real dtype); structural.

    State: `AdaBeliefState(mu, s, bt)`: first moment (`mu_dtype`, default the parameter dtype), the "belief" second
    moment of `g - m` (`nu_dtype`, default the real dtype), both starting at 0, and the running powers (β₁ᵗ, β₂ᵗ).

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

    lr: Hyper = 0.001
    beta: tuple[Hyper, Hyper] = (0.9, 0.999)
    eps: Hyper = 1e-16
    mu_dtype: Any = None
    nu_dtype: Any = None
    _static = ("mu_dtype", "nu_dtype")
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

    def init(self, x):
        return AdaBeliefState(mu_zeros(self, x), nu_zeros(self, x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        (m, s), bt = load(x, *state[:2]), state[2]
        b1, b2 = pair_of(self.beta, x)
        eps = eps_of(self.eps, x)
        m = b1 * m + (1 - b1) * dx
        s = b2 * s + (1 - b2) * abs2(dx - m) + eps
        c1, c2 = debias(bt)
        step = as_compute(self.lr, x) * m * c1 / (jnp.sqrt(s * c2) + eps)
        return AdaBeliefState(*store((m, s), state), bt_next(bt, self.beta, x)), step


class Lion(StateDtypes, Rule):
    """Lion (Chen et al. 2023, the paper's form): `step = η sign(β₁ m + (1 - β₁) g)` with the previous `m`,
    then `m ← β₂ m + (1 - β₂) g`. Optimisers.jl swaps the two EMA weights; this does not.

    Args:
        lr: learning rate η, default 1e-4, >= 0.
        beta: (β₁, β₂): the interpolation for the step and the momentum's decay, default (0.9, 0.99), each in
            [0, 1).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim._moments`.

    State: `m`, the momentum (`mu_dtype`, default the parameter dtype), starting at 0.

    Reference: X. Chen, C. Liang, D. Huang, E. Real, K. Wang, Y. Liu, H. Pham, X. Dong, T. Luong, C.-J. Hsieh,
    Y. Lu, Q. V. Le, "Symbolic Discovery of Optimization Algorithms", 2023, https://arxiv.org/abs/2302.06675

    optax: equals `optax.lion(η, b1, b2, weight_decay=0.0)` (optax's default weight decay is 1e-3), also with
    `mu_dtype`.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.Lion(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.9, 2.1], dtype=float32)
    """

    _formula = "lion"
    lr: Hyper = 1e-4
    beta: tuple[Hyper, Hyper] = (0.9, 0.99)
    mu_dtype: Any = None
    _static = ("mu_dtype",)
    _nonneg = ("lr",)
    _unit = ("beta",)

    def init(self, x):
        return mu_zeros(self, x)

    def apply(self, m0, x, dx, *dxs):
        (m,) = load(x, m0)
        b1, b2 = pair_of(self.beta, x)
        step = as_compute(self.lr, x) * jnp.sign(b1 * m + (1 - b1) * dx)
        return (b2 * m + (1 - b2) * dx).astype(m0.dtype), step


# ----------------------------------------------------------------------------------------------- gradient transforms
class WeightDecay(Rule):
    """L2 weight decay added to the gradient: `step = g + λ x`. Put it before the rule that scales the step:
    `OptimiserChain(WeightDecay(λ), Descent(η))` steps by `η (g + λ x)`.

    Args:
        weight_decay: λ, default 5e-4, >= 0.

    State: none (`None`).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.chain(optim.WeightDecay(0.5), optim.Descent(0.1)), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.9, 2. ], dtype=float32)
    """

    weight_decay: Hyper = 5e-4
    _nonneg = ("weight_decay",)

    def apply(self, state, x, dx, *dxs):
        return state, dx + as_compute(self.weight_decay, x) * x


class Scale(Rule):
    """Multiply the step by a constant: `step = f g`. As the last stage of a chain it scales another rule's
    step (`chain(Adam(1e-3), Scale(0.1))` steps by a tenth of Adam's); `f` is a hyperparameter like any other
    (adjustable, or a schedule), so `adjust(state, "encoder.*", f=0.5)` damps one part of a model.

    Args:
        f: the factor, required, any finite real number (a negative one steps uphill).

    State: none (`None`).

    optax: `optax.scale(f)` (whose update is added, so optax's `scale(-lr)` is this `Scale(lr)`).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.chain(optim.Descent(0.1), optim.Scale(0.5)), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.975, 2.05 ], dtype=float32)
    """

    f: Hyper
    _signed = ("f",)

    def apply(self, state, x, dx, *dxs):
        return state, as_compute(self.f, x) * dx


class SignDecay(Rule):
    """L1 weight decay added to the gradient: `step = g + λ sign(x)`.

    Args:
        weight_decay: λ, default 1e-3, >= 0.

    State: none (`None`).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.chain(optim.SignDecay(0.5), optim.Descent(0.1)), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.9 , 2.05], dtype=float32)
    """

    weight_decay: Hyper = 1e-3
    _nonneg = ("weight_decay",)

    def apply(self, state, x, dx, *dxs):
        return state, dx + as_compute(self.weight_decay, x) * jnp.sign(x)


class ClipGrad(Rule):
    """Clip each gradient entry to `[-δ, δ]`: `step = clamp(g, -δ, δ)`. Real parameters only (a complex one is a
    `TypeError` at `setup`; use `ClipNorm`).

    Args:
        delta: the bound δ, default 10.0, >= 0.

    State: none (`None`).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.chain(optim.ClipGrad(0.5), optim.Descent(0.1)), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.95, 2.05], dtype=float32)
    """

    delta: Hyper = 10.0
    _nonneg = ("delta",)

    def init(self, x):
        if jnp.iscomplexobj(x):
            raise TypeError("ClipGrad needs real parameters; use ClipNorm for complex ones")
        return None

    def apply(self, state, x, dx, *dxs):
        d = as_compute(self.delta, x)
        return state, jnp.clip(dx, -d, d)


def _pnorm(g: jax.Array, p: float) -> jax.Array:
    """The p-norm of all entries of `g` (p = 0 counts the non-zero entries; ±inf: largest / smallest |g|)."""
    a = jnp.abs(g)
    if p == 2:
        return jnp.sqrt(jnp.sum(abs2(g)))
    if p == float("inf"):
        return jnp.max(a)
    if p == float("-inf"):
        return jnp.min(a)
    if p == 0:
        return jnp.sum(a != 0).astype(a.dtype)
    if p == 1:
        return jnp.sum(a)
    return jnp.sum(a ** p) ** (1 / p)


class ClipNorm(Rule):
    """Rescale each array's gradient so its p-norm is at most `max_norm`: `g · min(ω / ‖g‖ₚ, 1)`.

    The norm is per array, as in Optimisers.jl; `ClipGlobalNorm` clips by the norm of the whole model. Unlike
    Optimisers.jl it cannot raise on a non-finite norm inside `jit`: a NaN or Inf gradient gives a NaN step.

    Args:
        max_norm: ω, default 10.0, >= 0.
        p: which norm, default 2; any number, including `float("inf")` (largest |g|) and 0 (structural).

    State: none (`None`).

    Reference: R. Pascanu, T. Mikolov, Y. Bengio, "On the difficulty of training recurrent neural networks",
    2013, https://arxiv.org/abs/1211.5063

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.chain(optim.ClipNorm(1.0), optim.Descent(0.1)), x)
    >>> state, x = optim.update(state, x, jnp.array([3.0, 4.0]))
    >>> x              # the gradient is clipped to [0.6, 0.8]
    Array([0.94, 1.92], dtype=float32)
    """

    max_norm: Hyper = 10.0
    p: float = 2
    _static = ("p",)
    _nonneg = ("max_norm",)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.p, (int, float)) or isinstance(self.p, bool) or self.p != self.p:
            raise TypeError(f"ClipNorm: p must be a number (2, 1, float('inf'), ...), got {self.p!r}")

    def apply(self, state, x, dx, *dxs):
        return state, dx * clip_factor(as_compute(self.max_norm, x), _pnorm(dx, float(self.p)))
