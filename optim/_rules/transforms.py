"""Gradient transforms, mostly chained before or after a rule: `WeightDecay`, `SignDecay`, `ClipGrad`,
`ClipNorm`, `Scale`.

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from .fields import nonneg, signed, static
from .schedules import Hyper
from .protocol import Rule, abs2, as_compute, clip_factor

__all__ = ["WeightDecay", "Scale", "SignDecay", "ClipGrad", "ClipNorm"]

class WeightDecay(Rule):
    """L2 weight decay added to the gradient: `step = g + λ x`. Put it before the rule that scales the step:
    `OptimiserChain(WeightDecay(λ), Descent(η))` steps by `η (g + λ x)`.

    Args:
        weight_decay: λ, default 5e-4, >= 0.

    State: none (`None`).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> rule = optim.chain(optim.WeightDecay(0.5), optim.Descent(0.1))
    >>> state = optim.setup(rule, x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.9, 2. ], dtype=float32)
    """

    weight_decay: Hyper = nonneg(5e-4)

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

    f: Hyper = signed()

    def apply(self, state, x, dx, *dxs):
        return state, as_compute(self.f, x) * dx


class SignDecay(Rule):
    """L1 weight decay added to the gradient: `step = g + λ sign(x)`.

    Args:
        weight_decay: λ, default 1e-3, >= 0.

    State: none (`None`).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> rule = optim.chain(optim.SignDecay(0.5), optim.Descent(0.1))
    >>> state = optim.setup(rule, x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.9 , 2.05], dtype=float32)
    """

    weight_decay: Hyper = nonneg(1e-3)

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

    delta: Hyper = nonneg(10.0)

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

    max_norm: Hyper = nonneg(10.0)
    p: float = static(2)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.p, (int, float)) or isinstance(self.p, bool) or self.p != self.p:
            raise TypeError(f"ClipNorm: p must be a number (2, 1, float('inf'), ...), got {self.p!r}")

    def apply(self, state, x, dx, *dxs):
        return state, dx * clip_factor(as_compute(self.max_norm, x), _pnorm(dx, float(self.p)))
