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

from . import _hyper
from ._tree import register_struct, struct_repr

__all__ = [
    "Rule", "Gated", "Replace", "apply_step",
    "Descent", "Momentum", "Nesterov", "Rprop", "RMSProp", "Adam", "RAdam", "AdaMax", "OAdam", "AdaGrad",
    "AdaDelta", "AMSGrad", "NAdam", "AdamW", "AdaBelief", "Lion", "WeightDecay", "SignDecay", "ClipGrad",
    "ClipNorm", "OptimiserChain", "chain", "AccumGrad", "MixedPrecision", "ClipGlobalNorm", "SkipNonFinite",
    "Muon", "apply_all",
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
        return _where(step.ok, apply_step(x, step.step), x)
    return (x - step).astype(x.dtype)


def _where(ok: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.where` with `ok` aligned on the leading axes: a stacked group's gate has one entry per member."""
    ok = jnp.asarray(ok)
    return jnp.where(ok.reshape(ok.shape + (1,) * (jnp.ndim(a) - ok.ndim)), a, b)


# ----------------------------------------------------------------------------------------------- base
class Rule:
    """Base class of optimisation rules.

    Subclasses are frozen dataclasses; `__init_subclass__` registers each as a pytree whose leaves are the
    non-static fields. A user-defined rule needs only `init` and `apply` (and may skip subclassing).

    The class attributes below declare each hyperparameter's range; the constructor checks concrete values
    (`optim._hyper`) and stores numbers as floats, so `adjust` never truncates one given as an int.
    A tuple default (`beta=(0.9, 0.999)`) makes the field a pair.
    """

    _static: ClassVar[tuple[str, ...]] = ()
    _nonneg: ClassVar[tuple[str, ...]] = ()   # finite and >= 0
    _unit: ClassVar[tuple[str, ...]] = ()     # each component in [0, 1) (decay rates that bias-correct: beta)
    _decay: ClassVar[tuple[str, ...]] = ()    # in [0, 1] (rho)
    _counts: ClassVar[tuple[str, ...]] = ()   # integers >= 1, kept integers (AccumGrad.n)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_struct(cls, cls._static)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name not in self._static:
                object.__setattr__(self, f.name, self._checked(f.name, getattr(self, f.name)))

    @classmethod
    def _checked(cls, name: str, v: Any) -> Any:
        """`v` checked and in stored form for the field `name` (used by the constructor and by `adjust`)."""
        owner = cls.__name__
        if name in cls._counts:
            return _hyper.count(owner, name, v)
        check = ("unit" if name in cls._unit else "closed_unit" if name in cls._decay
                 else "nonneg" if name in cls._nonneg else None)
        if check is None:   # a field this class does not declare (a user rule's): only make integers floating
            return float(v) if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) else v
        default = next((f.default for f in dataclasses.fields(cls) if f.name == name), None)
        if isinstance(default, tuple):
            return _hyper.pair(owner, name, v, check)
        return _hyper.hyper(owner, name, v, check)

    def init(self, x: jax.Array) -> Any:
        """The state for one parameter `x` (`None` for a stateless rule)."""
        return None

    def apply(self, state: Any, x: jax.Array, dx: jax.Array, *dxs: jax.Array) -> tuple[Any, Any]:
        """Return `(new_state, step)`; the parameter becomes `x - step`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return struct_repr(self)


def _real(x: jax.Array):
    return jnp.finfo(x.dtype).dtype


def _compute(x: jax.Array):
    """The dtype rules compute in: the parameter's real dtype, but at least float32 (in bfloat16 β₂ = 0.999
    rounds to 1 and Adam's bias correction divides by zero). States keep their own storage dtype."""
    return jnp.promote_types(_real(x), jnp.float32)


def _hp(v: Any, x: jax.Array) -> jax.Array:
    """A hyperparameter in the compute dtype of the parameter (Optimisers.jl casts to the parameter's dtype)."""
    return jnp.asarray(v, dtype=_compute(x))


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
    """Plain gradient descent: `step = η g`. Same as `optax.sgd(η)`."""

    lr: Any = 0.1
    _nonneg = ("lr",)

    def apply(self, state, x, dx, *dxs):
        return state, _hp(self.lr, x) * dx


class Momentum(Rule):
    """Gradient descent with momentum: `v ← ρ v + η g`, `step = v`.

    optax: the same steps as `optax.sgd(η, momentum=ρ)` while η is constant; optax keeps `t ← ρt + g` and
    scales by the current η, here `v` accumulates `η g`, so a changed η (adjust, schedule) affects new gradients.
    """

    lr: Any = 0.01
    rho: Any = 0.9
    _nonneg = ("lr",)
    _decay = ("rho",)

    def init(self, x):
        return jnp.zeros_like(x)

    def apply(self, v, x, dx, *dxs):
        v = _hp(self.rho, x) * v + _hp(self.lr, x) * dx
        return v, v


class Nesterov(Rule):
    """Nesterov momentum (PyTorch's `nesterov=True`): `step = -ρ² v + (1 + ρ) η g`, then `v ← ρ v - η g`.

    optax: the same as `optax.sgd(η, momentum=ρ, nesterov=True)` while η is constant (see `Momentum`).
    """

    lr: Any = 0.001
    rho: Any = 0.9
    _nonneg = ("lr",)
    _decay = ("rho",)

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
    and uses `√(q - |l|²)`. ε is outside the square root and ρ defaults to 0.9.

    optax: equals `optax.rmsprop(η, decay=ρ, eps=ε, eps_in_sqrt=False)` (centred: `centered=True`); optax's
    default puts ε inside the square root.
    """

    lr: Any = 0.001
    rho: Any = 0.9
    eps: Any = 1e-8
    centred: bool = False
    _static = ("centred",)
    _nonneg = ("lr", "eps")
    _decay = ("rho",)

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
    """Adam: `m ← β₁ m + (1 - β₁) g`, `v ← β₂ v + (1 - β₂)|g|²`, `step = η m̂ / (√v̂ + ε)`.

    optax: same as `optax.adam(η, b1, b2, eps)` (to float32 rounding: here `1 - β` is computed from β in the
    compute dtype, optax rounds the Python number, a relative difference of ~1e-5 in `v`).
    """

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    eps: Any = 1e-8
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

    def init(self, x):
        return jnp.zeros_like(x), _zeros_real(x), _bt_init(self.beta, x)

    def apply(self, state, x, dx, *dxs):
        m, v, bt = state
        m, v = _moments(self.beta, m, v, dx, x)
        step = m / (1 - bt[0]) / (jnp.sqrt(v / (1 - bt[1])) + _eps(self.eps, x)) * _hp(self.lr, x)
        return (m, v, _bt_next(bt, self.beta, x)), step


class RAdam(Rule):
    """Rectified Adam: with `ρ∞ = 2/(1 - β₂) - 1` and `ρ = ρ∞ - 2t bt₂/(1 - bt₂)`, `step = η r m̂ / (√v̂ + ε)`
    when `ρ > 4` (`r = √((ρ-4)(ρ-2)ρ∞ / ((ρ∞-4)(ρ∞-2)ρ))`), else `η m̂`.

    optax: equals `optax.radam(η, b1, b2, eps, threshold=4.0)`; optax tests ρ ≥ threshold with a default of 5.
    """

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    eps: Any = 1e-8
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

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
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

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
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

    def init(self, x):
        return jnp.zeros_like(x), _zeros_real(x), _bt_init(self.beta, x), jnp.zeros_like(x)

    def apply(self, state, x, dx, *dxs):
        m, v, bt, prev = state
        m, v = _moments(self.beta, m, v, dx, x)
        term = _hp(self.lr, x) * m / (1 - bt[0]) / (jnp.sqrt(v / (1 - bt[1])) + _eps(self.eps, x))
        return (m, v, _bt_next(bt, self.beta, x), term), 2 * term - prev


class AdaGrad(Rule):
    """AdaGrad: `acc ← acc + |g|²` (starting at ε), `step = η g / (√acc + ε)`.

    optax: adds eps inside `rsqrt` and starts the accumulator at 0.1; the closest is
    `optax.adagrad(η, initial_accumulator_value=ε, eps=0)`, which differs by the factor √acc / (√acc + ε).
    """

    lr: Any = 0.1
    eps: Any = 1e-8
    _nonneg = ("lr", "eps")

    def init(self, x):
        return jnp.full(x.shape, self.eps, _real(x))

    def apply(self, acc, x, dx, *dxs):
        acc = acc + _abs2(dx)
        return acc, dx * _hp(self.lr, x) / (jnp.sqrt(acc) + _eps(self.eps, x))


class AdaDelta(Rule):
    """AdaDelta (no learning rate): `a ← ρ a + (1 - ρ)|g|²`, `step = g √(d + ε) / √(a + ε)`,
    then `d ← ρ d + (1 - ρ)|step|²`.
    """

    rho: Any = 0.9
    eps: Any = 1e-8
    _nonneg = ("eps",)
    _decay = ("rho",)

    def init(self, x):
        return _zeros_real(x), _zeros_real(x)

    def apply(self, state, x, dx, *dxs):
        a, d = state
        rho, eps = _hp(self.rho, x), _eps(self.eps, x)
        a = rho * a + (1 - rho) * _abs2(dx)
        step = dx * jnp.sqrt(d + eps) / jnp.sqrt(a + eps)
        return (a, rho * d + (1 - rho) * _abs2(step)), step


class AMSGrad(Rule):
    """AMSGrad (no bias correction): `v̂ ← max(v̂, v)`, `step = η m / (√v̂ + ε)`; `m`, `v`, `v̂` start at ε.

    optax: equals `optax.amsgrad(η, b1, b2, eps, bias_correction_mu=False, bias_correction_nu=False)` with its
    moments started at ε; optax starts them at 0 and bias-corrects by default.
    """

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    eps: Any = 1e-8
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

    def init(self, x):
        e = _hp(self.eps, x)
        return jnp.full(x.shape, e, x.dtype), jnp.full(x.shape, e, _real(x)), jnp.full(x.shape, e, _real(x))

    def apply(self, state, x, dx, *dxs):
        m, v, vmax = state
        m, v = _moments(self.beta, m, v, dx, x)
        vmax = jnp.maximum(vmax, v)
        return (m, v, vmax), _hp(self.lr, x) * m / (jnp.sqrt(vmax) + _eps(self.eps, x))


class NAdam(Rule):
    """Nesterov Adam: `step = η (β₁ m / (1 - β₁ bt₁) + (1 - β₁) g / (1 - bt₁)) / (√(β₂ v / (1 - bt₂)) + ε)`.

    optax: `optax.nadam` omits Dozat's β₂ inside the root; `NAdam(η, β, ε)` equals
    `optax.nadam(η / √β₂, β₁, β₂, eps=ε / √β₂)`.
    """

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    eps: Any = 1e-8
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

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

    optax: `couple=True` equals `optax.adamw(η, b1, b2, eps, weight_decay=λ)` (optax's default λ is 1e-4).
    """

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    weight_decay: Any = 0.0
    eps: Any = 1e-8
    couple: bool = True
    _static = ("couple",)
    _nonneg = ("lr", "weight_decay", "eps")
    _unit = ("beta",)

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
    """AdaBelief: `s ← β₂ s + (1 - β₂)|g - m|² + ε`, `step = η m̂ / (√(s / (1 - bt₂)) + ε)`.

    optax: equals `optax.adabelief(η, b1, b2, eps=ε, eps_root=ε)`.
    """

    lr: Any = 0.001
    beta: Any = (0.9, 0.999)
    eps: Any = 1e-16
    _nonneg = ("lr", "eps")
    _unit = ("beta",)

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

    optax: equals `optax.lion(η, b1, b2, weight_decay=0.0)` (optax's default weight decay is 1e-3).
    """

    lr: Any = 1e-4
    beta: Any = (0.9, 0.99)
    _nonneg = ("lr",)
    _unit = ("beta",)

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

    The norm is per array, as in Optimisers.jl; `ClipGlobalNorm` clips by the norm of the whole model. Unlike Optimisers.jl it cannot raise on a non-finite norm inside `jit`: a NaN or Inf
    gradient gives a NaN step.
    """

    max_norm: Any = 10.0
    p: float = 2
    _static = ("p",)
    _nonneg = ("max_norm",)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.p, (int, float)) or isinstance(self.p, bool) or self.p != self.p:
            raise TypeError(f"ClipNorm: p must be a number (2, 1, float('inf'), ...), got {self.p!r}")

    def apply(self, state, x, dx, *dxs):
        return state, dx * _clip_factor(_hp(self.max_norm, x), _pnorm(dx, float(self.p)))


def _clip_factor(max_norm: jax.Array, norm: jax.Array) -> jax.Array:
    """`min(max_norm / norm, 1)`, but exactly 1 when the norm is within bounds: a zero gradient with
    `max_norm = 0` would otherwise give 0 / 0 = NaN. A NaN norm still gives NaN (a NaN step, not a silently
    unclipped one)."""
    ok = norm <= max_norm
    return jnp.where(ok, 1, max_norm / jnp.where(ok, 1, norm)).astype(max_norm.dtype)


def apply_all(rule: Any, states: list, xs: list, dxs: list) -> tuple[list, list]:
    """Run `rule` on several *stacks* of parameters at once. Entry `i` is a group of parameters stacked on a
    leading axis: `xs[i]`, its states `states[i]` (stacked alike) and `dxs[i]`, the tuple of its gradients.

    Rules that look across parameters (`ClipGlobalNorm`, `SkipNonFinite`, chains containing them) implement
    `apply_tree(states, xs, dxs)` over such stacks; every other rule's per-parameter `apply` is vmapped over
    each stack, which computes exactly what a loop over the parameters would.
    """
    if hasattr(rule, "apply_tree"):
        return rule.apply_tree(states, xs, dxs)
    out = [jax.vmap(rule.apply)(s, x, *d) for s, x, d in zip(states, xs, dxs)]
    return [o[0] for o in out], [o[1] for o in out]


def _one(rule: Any, state: Any, x: jax.Array, dxs: tuple) -> tuple[Any, Any]:
    """`apply` for one parameter, in terms of `apply_tree` (a stack of one)."""
    def lead(t):
        return jax.tree.map(lambda a: jnp.expand_dims(a, 0), t)

    states, steps = rule.apply_tree([lead(state)], [lead(x)], [lead(tuple(dxs))])
    return jax.tree.map(lambda a: a[0], states[0]), step_row(steps[0], 0)


def step_row(step: Any, m: int) -> Any:
    """Member `m`'s part of a stacked step (plain, `Gated` or `Replace`). A 0-d entry (a gate shared by the
    whole stack, as `SkipNonFinite` returns) has no row to take and applies to every member."""
    return jax.tree.map(lambda a: a if jnp.ndim(a) == 0 else a[m], step)


def _gate(new: Any, old: Any, ok: Any) -> Any:
    return new if ok is None else jax.tree.map(lambda a, b: _where(ok, a, b), new, old)


class OptimiserChain(Rule):
    """Apply rules in sequence, each to the previous one's step: `OptimiserChain(ClipGrad(1), Adam())`.

    A stage that returns no step (`None`) stops the chain; a `Gated` step (from `AccumGrad`) makes every later
    stage keep its state where the gate is closed, without branching. An empty chain acts like `Descent(1)`.
    The chain runs stage by stage across all parameters, so a stage that looks at the whole model
    (`ClipGlobalNorm`) sees the steps of the stages before it.
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
        return _one(self, states, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        n = len(xs)
        new = [list(s) for s in states]
        steps = [d[0] for d in dxs]
        oks: list = [None] * n
        for k, rule in enumerate(self.rules):
            live = [i for i in range(n) if steps[i] is not None]    # stages after a None step are skipped
            if not live:
                break
            got_states, got_steps = apply_all(rule, [states[i][k] for i in live], [xs[i] for i in live],
                                              [(steps[i], *dxs[i][1:]) for i in live])
            for i, st, step in zip(live, got_states, got_steps):
                new[i][k] = _gate(st, states[i][k], oks[i])
                if isinstance(step, Gated):
                    oks[i] = step.ok if oks[i] is None else oks[i] & step.ok
                    step = step.step
                if isinstance(step, Replace):
                    raise TypeError(f"{type(rule).__name__} replaces the parameter and must be the outermost rule")
                steps[i] = step
        out = [Gated(st, ok) if st is not None and ok is not None else st for st, ok in zip(steps, oks)]
        return [tuple(s) for s in new], out

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
    _counts = ("n",)

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
        return _one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        masters = [s[0] for s in states]
        inner, steps = apply_all(self.rule, [s[1] for s in states], masters,
                                 [tuple(d.astype(self.dtype) for d in ds) for ds in dxs])
        new_masters = [apply_step(m, st) for m, st in zip(masters, steps)]
        return ([(m, st) for m, st in zip(new_masters, inner)],
                [Replace(m.astype(x.dtype)) for m, x in zip(new_masters, xs)])


# ------------------------------------------------------------------------------------- whole-model rules
def _joint_norm(dxs: list) -> jax.Array:
    """The 2-norm of several arrays taken together, accumulated in float32 or wider."""
    total = sum((jnp.sum(_abs2(d).astype(jnp.promote_types(_real(d), jnp.float32))) for d in dxs),
                jnp.zeros((), jnp.float32))
    return jnp.sqrt(total)


class ClipGlobalNorm(Rule):
    """Rescale all gradients together so that their joint 2-norm is at most `max_norm`: `g · min(ω / ‖g‖, 1)`.

    The norm counts each parameter once, with the summed gradient of its tie group (optax's
    `clip_by_global_norm` counts a tied weight once per position). Put it first in a chain:
    `OptimiserChain(ClipGlobalNorm(1.0), AdamW(3e-4))`. Parameters with a `None` gradient do not count.
    The norm covers the parameters that share this rule: all of them, unless `setup` was given a rule per leaf,
    in which case each distinct rule clips its own parameters.

    >>> import jax.numpy as jnp, optim
    >>> m = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
    >>> s = optim.setup(optim.chain(optim.ClipGlobalNorm(1.0), optim.Descent(1.0)), m)
    >>> optim.update(s, m, {"a": jnp.array([3.0]), "b": jnp.array([4.0])})[1]
    {'a': Array([-0.6], dtype=float32), 'b': Array([-0.8], dtype=float32)}
    """

    max_norm: Any = 1.0
    _nonneg = ("max_norm",)

    def apply(self, state, x, dx, *dxs):
        return _one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        g = [d[0] for d in dxs]
        norm = _joint_norm(g)
        return list(states), [d * _clip_factor(_hp(self.max_norm, d), norm.astype(_real(d))) for d in g]


class SkipNonFinite(Rule):
    """Skip the whole step when any gradient has a NaN or Inf: the model and every parameter's state are left
    as they were (branch-free), and the state counts the skipped steps. Wrap the whole rule:
    `SkipNonFinite(OptimiserChain(ClipGlobalNorm(1.0), Adam()))`.

    >>> import jax.numpy as jnp, optim
    >>> m = {"a": jnp.ones(2)}
    >>> s, m2 = optim.update(optim.setup(optim.SkipNonFinite(optim.Adam()), m), m, {"a": jnp.array([1.0, jnp.nan])})
    >>> m2["a"], int(s["a"].state[1])
    (Array([1., 1.], dtype=float32), 1)
    """

    rule: Any = None

    def __init__(self, rule: Any):
        object.__setattr__(self, "rule", rule)

    def init(self, x):
        return self.rule.init(x), jnp.zeros((), jnp.int32)

    def apply(self, state, x, dx, *dxs):
        return _one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(d)) for ds in dxs for d in ds]))
        inner, steps = apply_all(self.rule, [s[0] for s in states], xs, list(dxs))
        new = [(_gate(st, s[0], ok), s[1] + jnp.where(ok, 0, 1).astype(jnp.int32)) for st, s in zip(inner, states)]
        return new, [None if st is None else Gated(st, ok) for st in steps]


# ------------------------------------------------------------------------------------- Muon
def _newton_schulz(g: jax.Array, steps: int, eps: jax.Array) -> jax.Array:
    """Approximately orthogonalise a matrix (the quintic Newton-Schulz iteration of Muon)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (jnp.sqrt(jnp.sum(_abs2(g))) + eps)
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        m = x @ jnp.conj(x).T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if tall else x


class Muon(Rule):
    """Muon (Jordan et al. 2024) for matrices: momentum `m ← ρ m + g`, the Nesterov direction `u = g + ρ m`
    (or `m`), then `step = η · max(1, rows/cols)^½ · NS₅(u)` where NS₅ orthogonalises `u` by five quintic
    Newton-Schulz iterations. 2-D parameters only: pair it with AdamW for the rest, e.g.
    `optim.setup(lambda path, x: optim.Muon(0.02) if x.ndim == 2 else optim.AdamW(3e-4), model)`.
    """

    lr: Any = 0.02
    rho: Any = 0.95
    eps: Any = 1e-7
    nesterov: bool = True
    steps: int = 5
    _static = ("nesterov", "steps")
    _nonneg = ("lr", "eps")
    _decay = ("rho",)

    def init(self, x):
        if x.ndim != 2:
            raise TypeError(f"Muon needs a 2-D parameter, got shape {tuple(x.shape)}; give it another rule")
        return jnp.zeros_like(x)

    def apply(self, m, x, dx, *dxs):
        rho = _hp(self.rho, x)
        m = rho * m + dx
        u = dx + rho * m if self.nesterov else m
        scale = max(1.0, x.shape[0] / x.shape[1]) ** 0.5
        return m, _hp(self.lr, x) * scale * _newton_schulz(u, self.steps, _hp(self.eps, x))
