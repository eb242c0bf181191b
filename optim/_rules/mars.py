"""MARS: AdamW on a variance-reduced gradient, corrected with the previous step's gradient.

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from .._base.export import register_for_export
from .fields import Small, nonneg, unit
from .moments import bt_init, bt_next, debias, moments
from .protocol import Rule, abs2, as_compute, eps_of, pair_of, zeros_real
from .schedules import Hyper

__all__ = ["MARS"]


@register_for_export
class MARSState(NamedTuple):
    """The state of MARS."""
    mu: Any              # first moment of the corrected gradients c
    nu: Any              # second moment of c
    g: Any               # the previous step's gradient (0 before the first step)
    bt: Small            # the products (∏β₁, ∏β₂) of the decay rates of the steps taken


class MARS(Rule):
    """MARS-AdamW with the approximate correction (Yuan et al. 2024): the gradient corrected by the previous
    step's gradient `g₋`, normalised where large, then AdamW on it:

    - `c = g + γ β₁ / (1 - β₁) (g - g₋)`, with `g₋ = 0` at the first step (the paper's code);
    - `c ← c / ‖c‖` where `‖c‖ > 1` (the 2-norm over the whole parameter);
    - `m ← β₁ m + (1 - β₁) c`, `v ← β₂ v + (1 - β₂)|c|²`, `step = η (m̂ / (√v̂ + ε) + λ x)`.

    With γ = 0 and gradients of norm at most 1 it is AdamW. The correction is the approximate one: the exact
    MARS evaluates the previous step's mini-batch at the current parameters (a second gradient per step); the
    paper recommends the approximation.

    Args:
        lr: learning rate η, default 3e-3 (the paper's code), >= 0.
        beta: decay rates (β₁, β₂) of the moments, default (0.95, 0.99), each in [0, 1); β₁ also scales the
            correction.
        gamma: γ, the weight of the correction, default 0.025, >= 0.
        eps: ε, added to `√v̂`, default 1e-8, >= 0.
        weight_decay: λ, decoupled, multiplied by η, default 0.0, >= 0.

    State: `MARSState(mu, nu, g, bt)`: first and second moments of `c` (the parameter's dtype and its real
    dtype), the previous gradient (the parameter's dtype), all starting at 0, and the products (β₁ᵗ, β₂ᵗ) of
    the bias corrections (as `Adam`'s `bt`). A parameter without a gradient (`None`, frozen) keeps its `g₋`,
    so its next correction is against the last gradient it had.

    Reference: H. Yuan, Y. Liu, S. Wu, X. Zhou, Q. Gu, "MARS: Unleashing the Power of Variance Reduction for
    Training Large Models", 2024, https://arxiv.org/abs/2411.10438 (MARS-AdamW, the approximate variant), and
    its code, https://github.com/AGI-Arena/MARS (`mars.py`, `mars_type="mars-adamw"`, `is_approx=True`).

    optax: no counterpart in optax 0.2.8 (`optax.contrib.mars` is proposed, unmerged). The paper's code steps
    1-D parameters with AdamW unless `optimize_1d`; here MARS steps every parameter it is given: choose per
    path with `optim.by_path`.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.MARS(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.03, -0.04]))
    >>> # c = 1.475 g (‖c‖ < 1), m̂ = c, √v̂ = |c|: the step is η sign(g)
    >>> x.round(4)
    Array([0.9, 2.1], dtype=float32)
    >>> state, x = optim.update(state, x, jnp.array([3.0, 4.0]))
    >>> # c = g + 0.475 (g - g₋) = (4.41, 5.92), of norm 7.4 > 1: divided by it
    >>> x.round(3)
    Array([0.823, 2.033], dtype=float32)
    """

    lr: Hyper = nonneg(3e-3)
    beta: tuple[Hyper, Hyper] = unit((0.95, 0.99))
    gamma: Hyper = nonneg(0.025)
    eps: Hyper = nonneg(1e-8)
    weight_decay: Hyper = nonneg(0.0)

    def init(self, x):
        return MARSState(jnp.zeros_like(x), zeros_real(x), jnp.zeros_like(x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        m, v, prev, bt = state
        bt = bt_next(bt, self.beta, x)
        b1, _ = pair_of(self.beta, x)
        c = dx + (as_compute(self.gamma, x) * b1 / (1 - b1)) * (dx - prev)
        # divide by max(‖c‖, 1): by ‖c‖ where it exceeds 1, else by 1 (no branch, and none at ‖c‖ = 0)
        c = c / jnp.maximum(jnp.sqrt(jnp.sum(abs2(c))), 1)
        m, v = moments(self.beta, m, v, c, x)
        c1, c2 = debias(bt)
        u = m * c1 / (jnp.sqrt(v * c2) + eps_of(self.eps, x)) + as_compute(self.weight_decay, x) * x
        step = as_compute(self.lr, x) * u
        return MARSState(m.astype(state.mu.dtype), v.astype(state.nu.dtype), dx.astype(prev.dtype), bt), step
