"""Rules of the SGD family and the sign-based ones: `Descent`, `Momentum`, `Nesterov`, `Rprop`, `Lion`.

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from .._base.export import register_for_export
from .fields import decay, initial, nonneg, static, unit
from .moments import load, mu_zeros, StateDtypes, store
from .schedules import Hyper
from .protocol import Rule, pair_of, as_compute, where

__all__ = ["Descent", "Momentum", "Nesterov", "Rprop", "Lion"]


# Named per-parameter states: `state["w"].state.mu` reads as the docstrings do, and `state_dict` keys by name.
# They flatten like the tuples they replaced (same leaves, same order), so stacking, vmap and old files agree.
@register_for_export
class RpropState(NamedTuple):
    g_prev: Any          # the previous gradient (0 after a sign flip)
    eta: Any             # the per-element step sizes


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
    lr: Hyper = nonneg(0.1)

    def apply(self, state, x, dx, *dxs):
        return state, as_compute(self.lr, x) * dx


class Momentum(StateDtypes, Rule):
    """Gradient descent with (heavy-ball) momentum: `v ← ρ v + η g`, `step = v`.

    Args:
        lr: learning rate η, default 0.01, >= 0.
        rho: momentum ρ, default 0.9, in [0, 1].
        mu_dtype: storage dtype of `v`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim.Quantized` for 8- and 4-bit formats.

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
    lr: Hyper = nonneg(0.01)
    rho: Hyper = decay(0.9)
    mu_dtype: Any = static(None)

    def init(self, x):
        return mu_zeros(self, x)

    def apply(self, v0, x, dx, *dxs):
        (v,) = load(x, v0)
        v = as_compute(self.rho, x) * v + as_compute(self.lr, x) * dx
        return store((v,), (v0,))[0], v


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

    lr: Hyper = nonneg(0.001)
    rho: Hyper = decay(0.9)

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
        lr: initial step size η of every element, default 1e-3, >= 0; read only by `init`, so a number, not a
            schedule.
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

    lr: Hyper = initial(1e-3)     # read only by init
    ell: tuple[Hyper, Hyper] = nonneg((0.5, 1.2))
    gamma: tuple[Hyper, Hyper] = nonneg((1e-6, 50.0))

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


class Lion(StateDtypes, Rule):
    """Lion (Chen et al. 2023, the paper's form): `step = η sign(β₁ m + (1 - β₁) g)` with the previous `m`,
    then `m ← β₂ m + (1 - β₂) g`. Optimisers.jl swaps the two EMA weights; this does not.

    Args:
        lr: learning rate η, default 1e-4, >= 0.
        beta: (β₁, β₂): the interpolation for the step and the momentum's decay, default (0.9, 0.99), each in
            [0, 1).
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16`, default None (the
            parameter's dtype); structural. See `optim.Quantized` for 8- and 4-bit formats.

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
    lr: Hyper = nonneg(1e-4)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.99))
    mu_dtype: Any = static(None)

    def init(self, x):
        return mu_zeros(self, x)

    def apply(self, m0, x, dx, *dxs):
        (m,) = load(x, m0)
        b1, b2 = pair_of(self.beta, x)
        step = as_compute(self.lr, x) * jnp.sign(b1 * m + (1 - b1) * dx)
        return store((b2 * m + (1 - b2) * dx,), (m0,))[0], step
