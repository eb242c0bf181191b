"""AdEMAMix: Adam with a mixture of two first moments, a fast one and a slow one that is not bias-corrected.

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from .._base.export import register_for_export
from .fields import Small, nonneg, static, unit
from .moments import bt_init, bt_next, debias, load, moments, mu_zeros, nu_zeros, StateDtypes, store
from .protocol import Rule, as_compute, eps_of
from .schedules import Hyper

__all__ = ["AdEMAMix"]


@register_for_export
class AdEMAMixState(NamedTuple):
    """The state of AdEMAMix."""
    mu: Any              # the fast first moment m₁ (decay β₁, bias-corrected)
    mu_slow: Any         # the slow first moment m₂ (decay β₃, not bias-corrected)
    nu: Any              # second moment
    bt: Small            # products (∏β₁, ∏β₂) of the steps taken, for the bias correction


class AdEMAMix(StateDtypes, Rule):
    """AdEMAMix: `m₁ ← β₁ m₁ + (1 - β₁) g`, `m₂ ← β₃ m₂ + (1 - β₃) g`, `v ← β₂ v + (1 - β₂)|g|²`, then
    `step = η ((m̂₁ + α m₂) / (√v̂ + ε) + λ x)` with `m̂₁ = m₁ / (1 - bt₁)` and `v̂ = v / (1 - bt₂)`. The slow
    moment `m₂` is not bias-corrected (it fills slowly, as the paper intends). The decay `λ x` is decoupled and
    multiplied by η (optax's and PyTorch's convention).

    The paper's warmups of α and β₃ are schedules on those hyperparameters (any hyperparameter may be an optim
    schedule): `alpha=optim.Linear(0.0, 5.0, T)` is its α warmup; its β₃ warmup
    `β₃(t) = min(exp(ln β ln β₃ / ((1 - t/T) ln β₃ + (t/T) ln β)), β₃)` (from β = β₁) is a `Schedule` subclass
    whose `__call__(step)` computes it. Schedules see the number of `update` calls so far (0 on the first step),
    optax's `count_m2`.

    Args:
        lr: learning rate η, default 1e-3, >= 0.
        beta: decay rates (β₁, β₂) of the fast moment and the second moment, default (0.9, 0.999), each in
            [0, 1).
        beta3: decay rate β₃ of the slow moment, default 0.9999, in [0, 1).
        alpha: α, the weight of the slow moment, default 5.0, >= 0.
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        weight_decay: λ, decoupled, multiplied by η, default 0.0, >= 0.
        mu_dtype: storage dtype of both first moments `m₁` and `m₂`, a real floating dtype such as
            `jnp.bfloat16` or a `Quantized` format (`optim.q8`, `optim.q4`), default None (the parameter's dtype);
            structural. See `optim.Quantized` for 8- and 4-bit formats.
        nu_dtype: storage dtype of `v`, default None (the parameter's real dtype); structural.

    State: `AdEMAMixState(mu, mu_slow, nu, bt)`: the fast and slow first moments (`mu_dtype`, default the
    parameter dtype), the second moment (`nu_dtype`, default the real dtype), all starting at 0, and the products
    (β₁ᵗ, β₂ᵗ) of the decay rates of the steps taken (1 at the start) as one array of 2. The step is computed
    from the new moments before they are rounded to their storage.

    Reference: M. Pagliardini, P. Ablin, D. Grangier, "The AdEMAMix Optimizer: Better, Faster, Older", 2024,
    https://arxiv.org/abs/2409.03050

    optax: equals `optax.contrib.ademamix(η, b1, b2, b3, alpha, eps, weight_decay=λ)` (the same defaults; in
    float64 to 1e-12 over 100 steps, also with α and β₃ schedules), with its `eps_root` at 0 and no `mask` (give
    parameters without decay another rule with `optim.by_path`). optax's `mu_dtype` stores `m₁`, `m₂` and `v`;
    here `mu_dtype` stores `m₁` and `m₂` and `nu_dtype` stores `v` (optax's `mu_dtype=d` is `mu_dtype=d,
    nu_dtype=d`, with `Adam`'s note on where `β m` is rounded).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.AdEMAMix(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> # m̂₁ = g, m₂ = 1e-4 g, v̂ = g²: η (1 + 5e-4) sign(g)
    >>> [round(float(v), 5) for v in x]
    [0.89995, 2.10005]
    >>> rule = optim.AdEMAMix(0.1, alpha=optim.Linear(0.0, 5.0, 100))
    >>> state = optim.setup(rule, x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> # α = 0 on the first step: Adam's step, η sign(g)
    >>> [round(float(v), 5) for v in x]
    [0.79995, 2.20005]
    """

    _formula = "ademamix"
    lr: Hyper = nonneg(1e-3)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    beta3: Hyper = unit(0.9999)
    alpha: Hyper = nonneg(5.0)
    eps: Hyper = nonneg(1e-8)
    weight_decay: Hyper = nonneg(0.0)
    mu_dtype: Any = static(None)
    nu_dtype: Any = static(None)

    def init(self, x):
        return AdEMAMixState(mu_zeros(self, x), mu_zeros(self, x), nu_zeros(self, x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        m1, m2, v = load(x, *state[:3])
        bt = bt_next(state[3], self.beta, x)
        b3, alpha = as_compute(self.beta3, x), as_compute(self.alpha, x)
        new_m1, new_v = moments(self.beta, m1, v, dx, x)
        new_m2 = b3 * m2 + (1 - b3) * dx
        c1, c2 = debias(bt)
        a = (new_m1 * c1 + alpha * new_m2) / (jnp.sqrt(new_v * c2) + eps_of(self.eps, x))
        step = as_compute(self.lr, x) * (a + as_compute(self.weight_decay, x) * x)
        return AdEMAMixState(*store((new_m1, new_m2, new_v), state[:3]), bt), step
