"""Optimisation rules: pure `init(x) -> state` and `apply(state, x, dx, *dxs) -> (state, step)` over one leaf.

The new parameter is `x - step`. Formulas and defaults follow Optimisers.jl v0.4 (Lion follows its paper).
Notation in the docstrings: `g` is the gradient, `η` the learning rate, `bt` the running power `β^t`
(it starts at `β`), `m̂ = m / (1 - bt₁)` and `v̂ = v / (1 - bt₂)`.

Every rule is a frozen dataclass registered as a pytree whose hyperparameters are leaves, so changing one with
`optim.adjust` changes data, never the compiled program. Fields named in `_static` are structural (they change
the state's shape or the program) and live in the treedef instead.

Gradients reach `apply` already summed over a tie group, cast to the parameter's dtype and, for complex
parameters, conjugated: JAX's gradient of a real loss w.r.t. a complex `w` is the conjugate of the steepest
descent direction, so after conjugation `x - η g` descends, as in Optimisers.jl and PyTorch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Rule", "Gated", "Replace", "apply_step",
    "Descent", "Momentum", "Nesterov", "Rprop", "RMSProp", "Adam", "RAdam", "AdaMax", "OAdam", "AdaGrad",
    "AdaDelta", "AMSGrad", "NAdam", "AdamW", "AdaBelief", "Lion", "WeightDecay", "SignDecay", "ClipGrad",
    "ClipNorm", "OptimiserChain", "chain", "AccumGrad", "MixedPrecision",
]


# ----------------------------------------------------------------------------------------------- steps
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gated:
    """A step that only happens where `ok` is true (branch-free "maybe no step", e.g. from `AccumGrad`).

    A chain that receives a `Gated` step keeps the state of every later stage unchanged where `ok` is false.
    """

    step: Any
    ok: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Replace:
    """Not a step but the new value of the parameter itself (used by `MixedPrecision`)."""

    value: jax.Array


def apply_step(x: jax.Array, step: Any) -> jax.Array:
    """`x - step`, keeping `x`'s dtype; understands `None` (no step), `Gated` and `Replace`."""
    if step is None:
        return x
    if isinstance(step, Replace):
        return step.value.astype(x.dtype)
    if isinstance(step, Gated):
        return jnp.where(step.ok, apply_step(x, step.step), x)
    return (x - step).astype(x.dtype)


# ----------------------------------------------------------------------------------------------- base
def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.number)) or (isinstance(v, np.ndarray) and v.ndim == 0)


class Rule:
    """Base class of optimisation rules.

    Subclasses are frozen dataclasses; `__init_subclass__` registers each as a pytree whose leaves are the
    non-static fields. A user-defined rule needs only `init` and `apply` (and may skip subclassing).
    """

    _static: ClassVar[tuple[str, ...]] = ()
    _nonneg: ClassVar[tuple[str, ...]] = ()   # hyperparameters that must be >= 0, checked when concrete

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True, repr=False)(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        data = tuple(n for n in names if n not in cls._static)
        meta = tuple(n for n in names if n in cls._static)

        def flatten_with_keys(rule):
            children = [(jax.tree_util.GetAttrKey(n), getattr(rule, n)) for n in data]
            return children, tuple(getattr(rule, n) for n in meta)

        def unflatten(aux, children):
            # Bypass __init__: JAX rebuilds rules with tracers or placeholders as leaves.
            rule = object.__new__(cls)
            for n, v in zip(data, children):
                object.__setattr__(rule, n, v)
            for n, v in zip(meta, aux):
                object.__setattr__(rule, n, v)
            return rule

        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten)

    def __post_init__(self):
        for name in self._nonneg:
            values = getattr(self, name)
            for v in values if isinstance(values, tuple) else (values,):
                if _is_number(v) and not float(np.real(v)) >= 0:
                    raise ValueError(f"{type(self).__name__}: {name} must be >= 0, got {v!r}")

    def init(self, x: jax.Array) -> Any:
        """The state for one parameter `x` (`None` for a stateless rule)."""
        return None

    def apply(self, state: Any, x: jax.Array, dx: jax.Array, *dxs: jax.Array) -> tuple[Any, Any]:
        """Return `(new_state, step)`; the parameter becomes `x - step`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        def fmt(v):
            if isinstance(v, tuple):
                return "(" + ", ".join(fmt(u) for u in v) + ")"
            if isinstance(v, (jax.Array, np.ndarray)) and v.ndim == 0:
                try:
                    v = v.item()
                except Exception:  # a tracer: show it as it is
                    pass
            if isinstance(v, float):
                return f"{v:g}"
            if isinstance(v, type) or isinstance(v, np.dtype):
                return jnp.dtype(v).name
            return repr(v)

        args = ", ".join(f"{f.name}={fmt(getattr(self, f.name))}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({args})"


def _real(x: jax.Array):
    return jnp.finfo(x.dtype).dtype


def _hp(v: Any, x: jax.Array) -> jax.Array:
    """A hyperparameter cast to the (real) dtype of the parameter, as Optimisers.jl does."""
    return jnp.asarray(v, dtype=_real(x))


def _eps(eps: Any, x: jax.Array) -> jax.Array:
    """ε in the parameter's real dtype, at least 1e-7 for 16-bit floats (Optimisers.jl #167)."""
    e = _hp(eps, x)
    if jnp.finfo(x.dtype).bits <= 16:
        e = jnp.maximum(e, jnp.asarray(1e-7, e.dtype))
    return e


def _abs2(g: jax.Array) -> jax.Array:
    return jnp.real(g * jnp.conj(g)) if jnp.iscomplexobj(g) else g * g


def _zeros_real(x: jax.Array) -> jax.Array:
    return jnp.zeros(x.shape, _real(x))


def _betas(beta: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _hp(beta[0], x), _hp(beta[1], x)


# ----------------------------------------------------------------------------------------------- rules
class Descent(Rule):
    """Plain gradient descent: `step = η g`."""

    lr: Any = 0.1
    _nonneg = ("lr",)

    def apply(self, state, x, dx, *dxs):
        return state, _hp(self.lr, x) * dx


class Momentum(Rule):
    """Gradient descent with momentum: `v ← ρ v + η g`, `step = v`."""

    lr: Any = 0.01
    rho: Any = 0.9
    _nonneg = ("lr", "rho")

    def init(self, x):
        return jnp.zeros_like(x)

    def apply(self, v, x, dx, *dxs):
        v = _hp(self.rho, x) * v + _hp(self.lr, x) * dx
        return v, v


class Nesterov(Rule):
    """Nesterov momentum (PyTorch's `nesterov=True`): `step = -ρ² v + (1 + ρ) η g`, then `v ← ρ v - η g`."""

    lr: Any = 0.001
    rho: Any = 0.9
    _nonneg = ("lr", "rho")

    def init(self, x):
        return jnp.zeros_like(x)

    def apply(self, v, x, dx, *dxs):
        lr, rho = _hp(self.lr, x), _hp(self.rho, x)
        step = -(rho * rho) * v + (1 + rho) * lr * dx
        return rho * v - lr * dx, step


class Rprop(Rule):
    """Resilient backprop: per-element rates grow by `ell[1]` (capped at `gamma[1]`) while the gradient keeps its
    sign and shrink by `ell[0]` (floored at `gamma[0]`) when it flips; `step = η ⊙ sign(g)`. Real parameters only.
    """

    lr: Any = 1e-3
    ell: Any = (0.5, 1.2)
    gamma: Any = (1e-6, 50.0)
    _nonneg = ("lr", "ell", "gamma")

    def init(self, x):
        if jnp.iscomplexobj(x):
            raise TypeError("Rprop needs real parameters (it compares gradient signs)")
        return jnp.zeros_like(x), jnp.full_like(x, _hp(self.lr, x))

    def apply(self, state, x, dx, *dxs):
        gp, eta = state
        (lo, hi), (gmin, gmax) = _betas(self.ell, x), _betas(self.gamma, x)
        s = gp * dx
        eta = jnp.where(s > 0, jnp.minimum(eta * hi, gmax), jnp.where(s < 0, jnp.maximum(eta * lo, gmin), eta))
        gp = jnp.where(s < 0, jnp.zeros_like(dx), dx)
        return (gp, eta), eta * jnp.sign(gp)


class RMSProp(Rule):
    """RMSProp: `q ← ρ q + (1 - ρ)|g|²`, `step = η g / (√q + ε)`; `centred=True` also tracks `l ← ρ l + (1 - ρ) g`
    and uses `√(q - |l|²)`. ε is outside the square root (optax puts it inside) and ρ defaults to 0.9.
    """

    lr: Any = 0.001
    rho: Any = 0.9
    eps: Any = 1e-8
    centred: bool = False
    _static = ("centred",)
    _nonneg = ("lr", "rho", "eps")

    def init(self, x):
        return _zeros_real(x), (jnp.zeros_like(x) if self.centred else None)

    def apply(self, state, x, dx, *dxs):
        q, l = state
        rho = _hp(self.rho, x)
        q = rho * q + (1 - rho) * _abs2(dx)
        if self.centred:
            l = rho * l + (1 - rho) * dx
            q_eff = q - _abs2(l)
        else:
            q_eff = q
        return (q, l), dx * _hp(self.lr, x) / (jnp.sqrt(q_eff) + _eps(self.eps, x))


def _moments(beta, m, v, dx, x):
    b1, b2 = _betas(beta, x)
    return b1 * m + (1 - b1) * dx, b2 * v + (1 - b2) * _abs2(dx)


def _bt_init(beta, x):
    # The running powers (β₁ᵗ, β₂ᵗ) as one array: one buffer and one kernel per parameter instead of two.
    return jnp.stack(_betas(beta, x))


def _bt_next(bt, beta, x):
    return bt * jnp.stack(_betas(beta, x))


class Adam(Rule):
    """Adam: `m ← β₁ m + (1 - β₁) g`, `v ← β₂ v + (1 - β₂)|g|²`, `step = η m̂ / (√v̂ + ε)`."""

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    eps: Any = 1e-8
    _nonneg = ("lr", "beta", "eps")

    def init(self, x):
        return jnp.zeros_like(x), _zeros_real(x), _bt_init(self.beta, x)

    def apply(self, state, x, dx, *dxs):
        m, v, bt = state
        m, v = _moments(self.beta, m, v, dx, x)
        step = m / (1 - bt[0]) / (jnp.sqrt(v / (1 - bt[1])) + _eps(self.eps, x)) * _hp(self.lr, x)
        return (m, v, _bt_next(bt, self.beta, x)), step


class RAdam(Rule):
    """Rectified Adam: with `ρ∞ = 2/(1 - β₂) - 1` and `ρ = ρ∞ - 2t bt₂/(1 - bt₂)`, `step = η r m̂ / (√v̂ + ε)`
    when `ρ > 4` (`r = √((ρ-4)(ρ-2)ρ∞ / ((ρ∞-4)(ρ∞-2)ρ))`), else `η m̂`. The threshold is 4 (optax and PyTorch: 5).
    """

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    eps: Any = 1e-8
    _nonneg = ("lr", "beta", "eps")

    def init(self, x):
        return jnp.zeros_like(x), _zeros_real(x), _bt_init(self.beta, x), jnp.ones((), jnp.int32)

    def apply(self, state, x, dx, *dxs):
        m, v, bt, t = state
        m, v = _moments(self.beta, m, v, dx, x)
        b2 = _hp(self.beta[1], x)
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * t.astype(b2.dtype) * bt[1] / (1 - bt[1])
        r = jnp.sqrt(jnp.maximum((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho), 0))
        lr, mhat = _hp(self.lr, x), m / (1 - bt[0])
        step = jnp.where(rho > 4, mhat * r / (jnp.sqrt(v / (1 - bt[1])) + _eps(self.eps, x)) * lr, mhat * lr)
        return (m, v, _bt_next(bt, self.beta, x), t + 1), step


class AdaMax(Rule):
    """AdaMax: `u ← max(β₂ u, |g|)`, `step = (η / (1 - bt₁)) m / (u + ε)`."""

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    eps: Any = 1e-8
    _nonneg = ("lr", "beta", "eps")

    def init(self, x):
        return jnp.zeros_like(x), _zeros_real(x), _bt_init(self.beta, x)

    def apply(self, state, x, dx, *dxs):
        m, u, bt = state
        b1, b2 = _betas(self.beta, x)
        m = b1 * m + (1 - b1) * dx
        u = jnp.maximum(b2 * u, jnp.abs(dx))
        step = (_hp(self.lr, x) / (1 - bt[0])) * m / (u + _eps(self.eps, x))
        return (m, u, _bt_next(bt, self.beta, x)), step


class OAdam(Rule):
    """Optimistic Adam: `T = η m̂ / (√v̂ + ε)`, `step = 2T - T_prev`."""

    lr: Any = 0.001
    beta: Any = (0.5, 0.9)
    eps: Any = 1e-8
    _nonneg = ("lr", "beta", "eps")

    def init(self, x):
        return jnp.zeros_like(x), _zeros_real(x), _bt_init(self.beta, x), jnp.zeros_like(x)

    def apply(self, state, x, dx, *dxs):
        m, v, bt, prev = state
        m, v = _moments(self.beta, m, v, dx, x)
        term = _hp(self.lr, x) * m / (1 - bt[0]) / (jnp.sqrt(v / (1 - bt[1])) + _eps(self.eps, x))
        return (m, v, _bt_next(bt, self.beta, x), term), 2 * term - prev


class AdaGrad(Rule):
    """AdaGrad: `acc ← acc + |g|²` (starting at ε), `step = η g / (√acc + ε)`."""

    lr: Any = 0.1
    eps: Any = 1e-8
    _nonneg = ("lr", "eps")

    def init(self, x):
        return jnp.full(x.shape, _hp(self.eps, x))

    def apply(self, acc, x, dx, *dxs):
        acc = acc + _abs2(dx)
        return acc, dx * _hp(self.lr, x) / (jnp.sqrt(acc) + _eps(self.eps, x))


class AdaDelta(Rule):
    """AdaDelta (no learning rate): `a ← ρ a + (1 - ρ)|g|²`, `step = g √(d + ε) / √(a + ε)`,
    then `d ← ρ d + (1 - ρ)|step|²`.
    """

    rho: Any = 0.9
    eps: Any = 1e-8
    _nonneg = ("rho", "eps")

    def init(self, x):
        return _zeros_real(x), _zeros_real(x)

    def apply(self, state, x, dx, *dxs):
        a, d = state
        rho, eps = _hp(self.rho, x), _eps(self.eps, x)
        a = rho * a + (1 - rho) * _abs2(dx)
        step = dx * jnp.sqrt(d + eps) / jnp.sqrt(a + eps)
        return (a, rho * d + (1 - rho) * _abs2(step)), step


class AMSGrad(Rule):
    """AMSGrad (no bias correction): `v̂ ← max(v̂, v)`, `step = η m / (√v̂ + ε)`; `m`, `v`, `v̂` start at ε."""

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    eps: Any = 1e-8
    _nonneg = ("lr", "beta", "eps")

    def init(self, x):
        e = _hp(self.eps, x)
        return jnp.full(x.shape, e, x.dtype), jnp.full(x.shape, e), jnp.full(x.shape, e)

    def apply(self, state, x, dx, *dxs):
        m, v, vmax = state
        m, v = _moments(self.beta, m, v, dx, x)
        vmax = jnp.maximum(vmax, v)
        return (m, v, vmax), _hp(self.lr, x) * m / (jnp.sqrt(vmax) + _eps(self.eps, x))


class NAdam(Rule):
    """Nesterov Adam: `step = η (β₁ m / (1 - β₁ bt₁) + (1 - β₁) g / (1 - bt₁)) / (√(β₂ v / (1 - bt₂)) + ε)`."""

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    eps: Any = 1e-8
    _nonneg = ("lr", "beta", "eps")

    def init(self, x):
        return jnp.zeros_like(x), _zeros_real(x), _bt_init(self.beta, x)

    def apply(self, state, x, dx, *dxs):
        m, v, bt = state
        b1, b2 = _betas(self.beta, x)
        m, v = _moments(self.beta, m, v, dx, x)
        num = b1 * m / (1 - b1 * bt[0]) + (1 - b1) * dx / (1 - bt[0])
        step = num / (jnp.sqrt(v * b2 / (1 - bt[1])) + _eps(self.eps, x)) * _hp(self.lr, x)
        return (m, v, _bt_next(bt, self.beta, x)), step


class AdamW(Rule):
    """Adam with decoupled weight decay. With `A` the Adam step at η = 1:
    `step = η (A + λ x)` (`couple=True`, PyTorch's convention) or `η A + λ x` (`couple=False`). λ defaults to 0.
    """

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    weight_decay: Any = 0.0
    eps: Any = 1e-8
    couple: bool = True
    _static = ("couple",)
    _nonneg = ("lr", "beta", "weight_decay", "eps")

    def init(self, x):
        return jnp.zeros_like(x), _zeros_real(x), _bt_init(self.beta, x)

    def apply(self, state, x, dx, *dxs):
        m, v, bt = state
        m, v = _moments(self.beta, m, v, dx, x)
        # Optimisers.jl: the inner Adam uses the raw ε, floored like every other rule for 16-bit floats here.
        a = m / (1 - bt[0]) / (jnp.sqrt(v / (1 - bt[1])) + _eps(self.eps, x))
        lr, wd = _hp(self.lr, x), _hp(self.weight_decay, x)
        step = lr * (a + wd * x) if self.couple else lr * a + wd * x
        return (m, v, _bt_next(bt, self.beta, x)), step


class AdaBelief(Rule):
    """AdaBelief: `s ← β₂ s + (1 - β₂)|g - m|² + ε`, `step = η m̂ / (√(s / (1 - bt₂)) + ε)`."""

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    eps: Any = 1e-16
    _nonneg = ("lr", "beta", "eps")

    def init(self, x):
        return jnp.zeros_like(x), _zeros_real(x), _bt_init(self.beta, x)

    def apply(self, state, x, dx, *dxs):
        m, s, bt = state
        b1, b2 = _betas(self.beta, x)
        eps = _eps(self.eps, x)
        m = b1 * m + (1 - b1) * dx
        s = b2 * s + (1 - b2) * _abs2(dx - m) + eps
        step = _hp(self.lr, x) * m / (1 - bt[0]) / (jnp.sqrt(s / (1 - bt[1])) + eps)
        return (m, s, _bt_next(bt, self.beta, x)), step


class Lion(Rule):
    """Lion (Chen et al. 2023, the paper's form): `step = η sign(β₁ m + (1 - β₁) g)` with the previous `m`,
    then `m ← β₂ m + (1 - β₂) g`. Optimisers.jl swaps the two EMA weights; this does not.
    """

    lr: Any = 1e-4
    beta: Any = (0.9, 0.99)
    _nonneg = ("lr", "beta")

    def init(self, x):
        return jnp.zeros_like(x)

    def apply(self, m, x, dx, *dxs):
        b1, b2 = _betas(self.beta, x)
        step = _hp(self.lr, x) * jnp.sign(b1 * m + (1 - b1) * dx)
        return b2 * m + (1 - b2) * dx, step


class WeightDecay(Rule):
    """L2 weight decay added to the gradient: `step = g + λ x`."""

    weight_decay: Any = 5e-4
    _nonneg = ("weight_decay",)

    def apply(self, state, x, dx, *dxs):
        return state, dx + _hp(self.weight_decay, x) * x


class SignDecay(Rule):
    """L1 weight decay added to the gradient: `step = g + λ sign(x)`."""

    weight_decay: Any = 1e-3
    _nonneg = ("weight_decay",)

    def apply(self, state, x, dx, *dxs):
        return state, dx + _hp(self.weight_decay, x) * jnp.sign(x)


class ClipGrad(Rule):
    """Clip each gradient entry to `[-δ, δ]`. Real parameters only."""

    delta: Any = 10.0
    _nonneg = ("delta",)

    def init(self, x):
        if jnp.iscomplexobj(x):
            raise TypeError("ClipGrad needs real parameters; use ClipNorm for complex ones")
        return None

    def apply(self, state, x, dx, *dxs):
        d = _hp(self.delta, x)
        return state, jnp.clip(dx, -d, d)


def _pnorm(g: jax.Array, p: float) -> jax.Array:
    a = jnp.abs(g)
    if p == 2:
        return jnp.sqrt(jnp.sum(_abs2(g)))
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

    The norm is per array, as in Optimisers.jl (see `ClipGlobalNorm`-style clipping in the interop work for a
    whole-model norm). Unlike Optimisers.jl it cannot raise on a non-finite norm inside `jit`: a NaN or Inf
    gradient gives a NaN step.
    """

    max_norm: Any = 10.0
    p: float = 2
    _static = ("p",)
    _nonneg = ("max_norm",)

    def apply(self, state, x, dx, *dxs):
        n = _pnorm(dx, float(self.p))
        return state, dx * jnp.minimum(_hp(self.max_norm, x) / n, 1)


class OptimiserChain(Rule):
    """Apply rules in sequence, each to the previous one's step: `OptimiserChain(ClipGrad(1), Adam())`.

    A stage that returns no step (`None`) stops the chain; a `Gated` step (from `AccumGrad`) makes every later
    stage keep its state where the gate is closed, without branching. An empty chain acts like `Descent(1)`.
    """

    rules: tuple = ()

    def __init__(self, *rules: Any):
        if len(rules) == 1 and isinstance(rules[0], (list, tuple)):
            rules = tuple(rules[0])
        for r in rules:
            if isinstance(r, MixedPrecision):
                raise TypeError("MixedPrecision must wrap the whole chain, not sit inside it: "
                                "MixedPrecision(jnp.float32, OptimiserChain(...))")
            if not (hasattr(r, "init") and hasattr(r, "apply")):
                raise TypeError(f"OptimiserChain: {r!r} is not a rule (it needs init and apply)")
        object.__setattr__(self, "rules", tuple(rules))

    def init(self, x):
        return tuple(r.init(x) for r in self.rules)

    def apply(self, states, x, dx, *dxs):
        new, ok, step = [], None, dx
        for rule, st in zip(self.rules, states):
            if step is None:                       # an earlier stage returned no step: keep later states
                new.append(st)
                continue
            st2, step = rule.apply(st, x, step, *dxs)
            if ok is not None:
                st2 = jax.tree.map(lambda a, b: jnp.where(ok, a, b), st2, st)
            new.append(st2)
            if isinstance(step, Gated):
                ok = step.ok if ok is None else ok & step.ok
                step = step.step
            if isinstance(step, Replace):
                raise TypeError(f"{type(rule).__name__} replaces the parameter and must be the outermost rule")
        if step is not None and ok is not None:
            step = Gated(step, ok)
        return tuple(new), step

    def __repr__(self):
        return "OptimiserChain(" + ", ".join(map(repr, self.rules)) + ")"


def chain(*rules: Any) -> OptimiserChain:
    """Alias of `OptimiserChain(*rules)`."""
    return OptimiserChain(*rules)


class AccumGrad(Rule):
    """Accumulate `g / n` over `n` calls and return the sum on the n-th, no step on the others (branch-free).

    Put it first in a chain: `OptimiserChain(AccumGrad(4), Adam())` steps Adam once every 4 calls.
    """

    n: Any = 1

    def __post_init__(self):
        if _is_number(self.n) and (int(self.n) != self.n or self.n < 1):
            raise ValueError(f"AccumGrad: n must be a positive integer, got {self.n!r}")

    def init(self, x):
        return jnp.zeros_like(x), jnp.ones((), jnp.int32)

    def apply(self, state, x, dx, *dxs):
        acc, k = state
        n = jnp.asarray(self.n, jnp.int32)
        acc = jnp.where(k == 1, dx / n.astype(x.dtype), acc + dx / n.astype(x.dtype))
        done = k >= n
        return (acc, jnp.where(done, 1, k + 1)), Gated(acc, done)


class MixedPrecision(Rule):
    """Run `rule` on a high-precision master copy kept in the state, then write it back rounded to `x`'s dtype:
    `MixedPrecision(jnp.float32, Adam())` for float16 / bfloat16 parameters. It must wrap the whole chain.
    """

    dtype: Any = jnp.float32
    rule: Any = None
    _static = ("dtype",)

    def __init__(self, dtype: Any = jnp.float32, rule: Any = None):
        if rule is None and hasattr(dtype, "apply"):
            dtype, rule = jnp.float32, dtype
        if rule is None:
            raise TypeError("MixedPrecision(dtype, rule) needs a rule")
        if not jnp.issubdtype(jnp.dtype(dtype), jnp.inexact):
            raise TypeError(f"MixedPrecision: {dtype!r} is not a floating dtype")
        object.__setattr__(self, "dtype", jnp.dtype(dtype))
        object.__setattr__(self, "rule", rule)

    def init(self, x):
        xt = x.astype(self.dtype)
        return xt, self.rule.init(xt)

    def apply(self, state, x, dx, *dxs):
        xt, st = state
        st, step = self.rule.apply(st, xt, dx.astype(self.dtype), *(d.astype(self.dtype) for d in dxs))
        xt = apply_step(xt, step)
        return (xt, st), Replace(xt.astype(x.dtype))
