"""The matrix rules: `Muon`, momentum orthogonalised by Newton-Schulz, and `NorMuon`, Muon with each output
neuron's row normalised by a running second moment.

Each runs per parameter like any rule (vmapped over a stack, so every stacked matrix is orthogonalised alone; a
tie group is one parameter, with its summed gradient). The iteration's coefficients (`ns_coeffs`) and the
scaling before it (`preconditioning`) mean what optax.contrib.muon's do.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import hyper as _hyper
from . import split as _devices
from .._base.export import register_for_export
from .fields import Small, flag, nonneg, static, unit
from .moments import load, mu_zeros, StateDtypes, store
from .schedules import Hyper
from .protocol import Rule, abs2, as_compute, real_dtype

__all__ = ["Muon", "NorMuon"]

# Keller Jordan's quintic (a, b, c), the same for every step (optax's "standard").
_STANDARD = (3.4445, -4.7750, 2.0315)
# One triple per step: optax's "dion" (Ahn et al. 2025) ...
_DION = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
         (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
# ... and Polar Express (Amsel et al. 2025, Algorithm 1, degree 5): the first seven divided by the paper's safety
# factor (a / 1.01, b / 1.01³, c / 1.01⁵, so that rounding cannot push a singular value past the polynomial's
# interval); the last is the limit every later step repeats.
_POLAR_EXPRESS = tuple((a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5) for a, b, c in (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248))) + ((1.875, -1.25, 0.375),)
_PRESETS = {"standard": _STANDARD, "dion": _DION, "polar_express": _POLAR_EXPRESS}
_PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")


def _coeffs_arg(owner: str, v: Any) -> Any:
    """`ns_coeffs` checked: a preset's name, one triple `(a, b, c)` or a tuple of triples (one per step), the
    numbers as Python floats (a structural field must hash and compare by value)."""
    what = '"standard", "dion", "polar_express", a triple (a, b, c) or a tuple of triples (one per step)'
    if isinstance(v, str):
        if v not in _PRESETS:
            raise ValueError(f"{owner}: ns_coeffs must be {what}, got {v!r}")
        return v
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: ns_coeffs must be {what}, got {type(v).__name__} {v!r}") from None
    if a.shape not in ((3,),) and not (a.ndim == 2 and a.shape[0] >= 1 and a.shape[1] == 3):
        raise TypeError(f"{owner}: ns_coeffs must be {what}, got an array of shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{owner}: ns_coeffs must be finite, got {v!r}")
    return tuple(map(float, a)) if a.ndim == 1 else tuple(tuple(map(float, r)) for r in a)


def _schedule(owner: str, ns_coeffs: Any, steps: int | None) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of each Newton-Schulz step. One triple repeats `steps` times (default 5). A tuple of triples
    (or "dion") fixes the number of steps to its length, as optax's `ns_steps` is then ignored; a `steps` that
    disagrees is refused. "polar_express" follows the paper's code: its first `steps`, the last one repeated."""
    table = _PRESETS.get(ns_coeffs, ns_coeffs) if isinstance(ns_coeffs, str) else ns_coeffs
    if ns_coeffs == "polar_express":
        n = 5 if steps is None else steps
        return table[:n] + (table[-1],) * (n - len(table))
    if not isinstance(table[0], tuple):
        return (table,) * (5 if steps is None else steps)
    if steps is not None and steps != len(table):
        raise ValueError(f"{owner}: steps={steps} disagrees with the {len(table)} per-step ns_coeffs (one triple "
                         f"per step: the number of steps is their number); leave steps out or give steps="
                         f"{len(table)}")
    return table


def _ns_step(x: jax.Array, coeffs: tuple, first: bool, preconditioning: str, eps: jax.Array) -> jax.Array:
    """One quintic step `X ← a X + (b A + c A²) X`, `A = X Xᴴ`. On the first step, "aol" rescales X's rows by
    `D^(-1/2)`, `D` the absolute row sums of `A` (Gershgorin: then every singular value is <= 1), and "schatten"
    divides X by `‖A‖_F^(1/2)` (the Schatten-4 norm of X, >= the spectral norm); either rescales `A` to match,
    so the step costs no extra product. Both floor the divisor at ε."""
    a, b, c = coeffs
    m = x @ jnp.conj(x).T
    if first and preconditioning == "aol":
        s = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.abs(m), axis=-1), eps))[:, None]
        x, m = x * s, m * s * s.T
    elif first and preconditioning == "schatten":
        s = jax.lax.rsqrt(jnp.maximum(jnp.sqrt(jnp.sum(abs2(m))), eps))
        x, m = x * s, m * s * s
    return a * x + (b * m + c * m @ m) @ x


def _newton_schulz(g: jax.Array, schedule: tuple, preconditioning: str, eps: jax.Array) -> jax.Array:
    """Approximately orthogonalise a matrix (the quintic Newton-Schulz iteration of Muon) on the wide
    orientation of `g` (the Gram matrix `X Xᴴ` is then the smaller one): `X = g / (‖g‖_F + ε)` ("frobenius") or
    `g / (‖g‖₂ + ε)` ("spectral"; "aol" and "schatten" scale in the first step), then one `_ns_step` per triple
    of `schedule`."""
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    if preconditioning == "frobenius":
        x = x / (jnp.sqrt(jnp.sum(abs2(x))) + eps)
    elif preconditioning == "spectral":
        x = x / (jnp.linalg.norm(x, ord=2) + eps)
    for i, coeffs in enumerate(schedule):
        x = _ns_step(x, coeffs, i == 0, preconditioning, eps)
    return x.T if tall else x


def _whole(a: jax.Array) -> tuple[jax.Array, Any]:
    """`a` replicated over its mesh when its sharding is part of its type and splits it (Explicit mesh axes:
    ZeRO-1's sharded momentum, an FSDP parameter), and that sharding, to put the result back; else `(a, None)`.
    Newton-Schulz's products `X Xᴴ` contract the axes such a sharding splits, which JAX refuses to type
    ("contracting dimensions are sharded"): the whole matrix is orthogonalised on every device instead (with
    Auto axes XLA chooses the same or its own partitioning)."""
    s = getattr(jax.typeof(a), "sharding", None)
    if not isinstance(s, jax.sharding.NamedSharding) or s.mesh.empty or all(d is None for d in s.spec):
        return a, None
    return jax.sharding.reshard(a, jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())), s


def _axes(v: Any) -> tuple[int, ...] | None:
    """An axis argument (an int, a sequence of ints, or None) as a tuple of ints, or None."""
    if v is None:
        return None
    return (operator.index(v),) if not isinstance(v, (tuple, list)) else tuple(operator.index(a) for a in v)


@register_for_export
class MuonState(NamedTuple):
    mu: Any              # the momentum
    count: Small         # the parameter's number of steps, int32


class _Matrix(StateDtypes, Rule):
    """What Muon and NorMuon share: the checks of their structural fields, the matrix a parameter is seen as,
    the momentum direction, the orthogonalisation and the shape scale. Declares no field."""

    _across = False         # per parameter: `apply_tree` only splits a stack's rows across devices
    _split_large = True     # on a mesh of several devices its large parameters are stacked, to be split

    def __post_init__(self):
        super().__post_init__()
        owner = type(self).__name__
        if self.steps is not None:
            object.__setattr__(self, "steps", _hyper.whole(owner, "steps", self.steps, 1,
                                                           "with no iteration the momentum is not orthogonalised"))
        object.__setattr__(self, "ns_coeffs", _coeffs_arg(owner, self.ns_coeffs))
        _schedule(owner, self.ns_coeffs, self.steps)      # a steps that disagrees with per-step coefficients
        if not isinstance(self.preconditioning, str):
            raise TypeError(f"{owner}: preconditioning must be one of {', '.join(map(repr, _PRECONDITIONINGS))}, "
                            f"got {type(self.preconditioning).__name__} {self.preconditioning!r}")
        if self.preconditioning not in _PRECONDITIONINGS:
            raise ValueError(f"{owner}: preconditioning must be one of {', '.join(map(repr, _PRECONDITIONINGS))}, "
                             f"got {self.preconditioning!r}")
        for name in ("reduction_axis", "output_axis"):
            try:
                object.__setattr__(self, name, _axes(getattr(self, name)))
            except TypeError:
                raise TypeError(f"{owner}: {name} must be an int or a tuple of ints, got "
                                f"{getattr(self, name)!r}") from None
        if self.reduction_axis is None:
            raise TypeError(f"{owner}: reduction_axis must be an int or a tuple of ints, got None")

    def apply_tree(self, states, xs, dxs):
        # `apply` vmapped over each stack (as for any rule), each device stepping its share of the stack's
        # matrices on a mesh of several devices (optim._rules.split)
        out = [_devices.rows(lambda rule, s, x, d: jax.vmap(rule.apply)(s, x, *d), self, s, x, tuple(d))
               for s, x, d in zip(states, xs, dxs)]
        return [o[0] for o in out], [o[1] for o in out]

    @classmethod
    def _checked(cls, name: str, v: Any) -> Any:
        if name == "consistent_rms" and v is None:
            return None
        return super()._checked(name, v)

    def _matrix(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The (batch, reduction, output) axes of a parameter of `shape`, checked."""
        n, owner, shape = len(shape), type(self).__name__, tuple(shape)
        if n < 2:
            raise TypeError(f"{owner} needs a parameter with at least 2 axes (a matrix), got shape {shape}; "
                            "give it another rule")
        for name, axes in (("reduction_axis", self.reduction_axis), ("output_axis", self.output_axis)):
            if axes is not None and any(not -n <= a < n for a in axes):
                raise TypeError(f"{owner}: {name}={axes} is out of range for a parameter of shape {shape}")
        red = tuple(a % n for a in self.reduction_axis)
        out = tuple(a % n for a in self.output_axis) if self.output_axis is not None else \
            tuple(a for a in range(n) if a not in red)
        if not red or not out or set(red) & set(out) or len(set(red)) < len(red) or len(set(out)) < len(out):
            raise TypeError(f"{owner}: reduction axes {red} and output axes {out} must be non-empty, distinct and "
                            f"disjoint (parameter shape {shape})")
        return tuple(a for a in range(n) if a not in red and a not in out), red, out

    def _direction(self, state: Any, x: jax.Array, dx: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`(m, u, t)`: the new momentum, the direction to orthogonalise (Nesterov or bias-corrected) and the new
        count."""
        beta = as_compute(self.rho, x)
        count = state.count + 1
        (mu,) = load(x, state.mu)
        g = dx.astype(jnp.promote_types(dx.dtype, mu.dtype))
        mu = beta * mu + (1 - beta) * g
        t = count.astype(beta.dtype)
        if self.nesterov:
            return mu, beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta ** t), count
        return mu, mu / (1 - beta ** t), count

    def _orthogonal(self, u: jax.Array, x: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
        """`(O, back)`: `u` as a stack of (fan_in, fan_out) matrices (batch, reduction, output), each
        orthogonalised, and the function that puts such a stack back in `u`'s layout."""
        batch, red, out = self._matrix(u.shape)
        order = batch + red + out
        size = lambda axes: math.prod(u.shape[a] for a in axes)   # noqa: E731
        o = u.transpose(order).reshape(size(batch), size(red), size(out))
        schedule = _schedule(type(self).__name__, self.ns_coeffs, self.steps)
        eps = as_compute(self.eps, x)
        o = jax.vmap(lambda m: _newton_schulz(m, schedule, self.preconditioning, eps))(o)
        return o, lambda a: a.reshape(tuple(u.shape[i] for i in order)).transpose(np.argsort(order))

    def _scale(self, x: jax.Array) -> Any:
        """The shape scale `s`: `√max(1, fan_out / fan_in)`, or `r √max(fan_in, fan_out)` with `consistent_rms`."""
        _, red, out = self._matrix(x.shape)
        fan_in, fan_out = math.prod(x.shape[a] for a in red), math.prod(x.shape[a] for a in out)
        if self.consistent_rms is None:
            return max(1.0, fan_out / fan_in) ** 0.5
        return max(fan_in, fan_out) ** 0.5 * as_compute(self.consistent_rms, x)


class Muon(_Matrix):
    """Muon (Jordan et al. 2024): momentum orthogonalised by Newton-Schulz. With `t` the parameter's step:

    - `m ← β m + (1 - β) g`; the direction `u = β m / (1 - βᵗ⁺¹) + (1 - β) g / (1 - βᵗ)` (Nesterov), or
      `u = m / (1 - βᵗ)`;
    - `O = NS(u)`: `u` seen as a matrix (fan_in x fan_out: the reduction axes by the output axes, any other
      axis a batch of matrices), orthogonalised by quintic Newton-Schulz iterations (singular values pushed
      towards 1) on its wide orientation: `X` = `u` scaled by the `preconditioning`, then for each step's
      `(a, b, c)` of `ns_coeffs`, `A = X Xᴴ`, `X ← a X + (b A + c A²) X`; with `adaptive`, `O ← ⟨u, O⟩ O`;
    - `step = η (s O + λ x)`, with the width scale `s = √max(1, fan_out / fan_in)`, or, with `consistent_rms`
      `r`, `s = r √max(fan_in, fan_out)` (an update RMS independent of the shape, like AdamW's at `r ≈ 0.2`).

    For a parameter `x @ W` with `W` of shape (in, out) the defaults are optax's: reduction axis 0, output axis
    1. A parameter with more than 2 axes is reshaped to `(shape[0], -1)` (output axes: every other one), or
    give `reduction_axis` / `output_axis` (a convolution kernel `(h, w, in, out)`: `reduction_axis=(0, 1, 2)`;
    axes in neither are a batch, each slice orthogonalised alone). Vectors and scalars are a `TypeError` at
    `setup`: give them another rule, e.g. `by_path({"*.kernel": Muon(0.02), "*": AdamW(3e-4)})` or
    `setup(lambda path, x: Muon(0.02) if x.ndim >= 2 else AdamW(3e-4), model)`.

    Args:
        lr: learning rate η, default 0.02, >= 0.
        rho: momentum β, default 0.95, in [0, 1) (optax's `beta`).
        eps: ε added to the norm that scales `u` before the iteration (the floor of the first step's divisor with
            "aol" and "schatten"), default 1e-8, >= 0.
        weight_decay: λ, decoupled, multiplied by η (optax's, PyTorch's convention), default 0.0, >= 0.
        consistent_rms: r, default None (the width scale); a number >= 0 selects the consistent-RMS scale.
            None or a number is structural (it changes the program); the number is adjustable.
        nesterov: the Nesterov direction (else the bias-corrected momentum), default True (structural).
        adaptive: scale `O` by `⟨u, O⟩` (Bernstein & Newhouse's dual norm), default False (structural).
        steps: number of Newton-Schulz iterations, an integer >= 1 (structural; 0 would skip the
            orthogonalisation that makes it Muon); default None: 5, or the number of per-step `ns_coeffs`
            (given with per-step coefficients, it must equal their number: a `ValueError` otherwise).
        reduction_axis, output_axis: the matrix's axes, default 0 and None (every axis but the reduction
            ones); ints or tuples of ints, negative counting from the end (structural).
        mu_dtype: storage dtype of `m`, default None (the parameter's dtype); structural.
        ns_coeffs: the iteration's coefficients (structural), default "standard": Jordan's
            `(3.4445, -4.7750, 2.0315)` at every step; "dion": Ahn et al.'s five per-step triples (optax's);
            "polar_express": Amsel et al.'s Algorithm 1 (degree 5, safety factor 1.01 applied), its first
            `steps` triples (default 5; past its eighth, the last repeats, as in the paper's code); a triple
            `(a, b, c)` for every step; or a tuple of triples, one per step.
        preconditioning: how `u` is scaled before the iteration (structural), default "frobenius":
            `u / (‖u‖_F + ε)`; "spectral": `u / (‖u‖₂ + ε)` (the largest singular value, an SVD: exact but
            costly); "aol": the first step rescales row `i` of `X = u` by `1/√max(Σⱼ|Aᵢⱼ|, ε)`, `A = X Xᴴ`
            (Boissin et al.'s almost-orthogonal layer: every singular value <= 1, often one step fewer);
            "schatten": the first step divides `X = u` by `√max(‖A‖_F, ε)`, its Schatten-4 norm (Grishina
            et al.). Both reuse the rescaled `A`, at no extra product.

    State: `MuonState(mu, count)`: the momentum `m` (starting at 0) and the parameter's number of steps (int32).
    Counts are per parameter: one with no step (a `None` gradient, frozen) keeps its `t`.

    Reference: K. Jordan, Y. Jin, V. Boza, J. You, F. Cesista, L. Newhouse, J. Bernstein, "Muon: An optimizer
    for hidden layers in neural networks", 2024, https://kellerjordan.github.io/posts/muon/; the consistent
    RMS: J. Liu et al., "Muon is Scalable for LLM Training", 2025, arXiv:2502.16982; adaptive: J. Bernstein,
    L. Newhouse, "Old Optimizer, New Norm: An Anthology", 2024, arXiv:2409.20325; "dion": K. Ahn et al.,
    "Dion: Distributed Orthonormalized Updates", 2025, arXiv:2504.05295; "polar_express": N. Amsel, D. Persson,
    C. Musco, R. M. Gower, "The Polar Express: Optimal Matrix Sign Methods and Their Application to the Muon
    Algorithm", 2025, https://arxiv.org/abs/2505.16932; "aol": T. Boissin et al., "Turbo-Muon: Accelerating
    Orthogonality-Based Optimization with Pre-Conditioning", 2025, arXiv:2512.04632; "schatten": E. Grishina
    et al., "Accelerating Newton-Schulz Iteration for Orthogonalization via Chebyshev-type Polynomials", 2025,
    arXiv:2506.10935.

    optax: `Muon(η)` is `optax.contrib.muon(η)` on 2-D parameters (same defaults; its `beta` is `rho`,
    `muon_weight_dimension_numbers=MuonDimensionNumbers(r, o)` is `reduction_axis=r, output_axis=o`). optax
    sends every other parameter to AdamW; here that is the rule you pair Muon with. optax counts steps once for
    the whole tree, here per parameter (the same unless some parameter skips a step). `ns_coeffs` and
    `preconditioning` are optax's, with these differences: optax has no "polar_express" preset (give it the
    paper's first 5 triples with its safety factor, `(a / 1.01, b / 1.01³, c / 1.01⁵)`); with per-step
    coefficients optax runs their number of steps for any `ns_steps` not below it, where a `steps` that
    disagrees is refused here; "aol" and "schatten" floor their divisor at ε, optax at 1e-8 whatever its `eps`
    (the same at the default); and "schatten" uses `X Xᴴ` where optax uses `X Xᵀ` (the same for real
    parameters).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.zeros((2, 2))
    >>> state = optim.setup(optim.Muon(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([[3.0, 0.0], [0.0, 4.0]]))
    >>> # u ∝ g; its singular values, 0.6 and 0.8 once normalised, become 0.72 and
    >>> # 1.12
    >>> x.round(2)
    Array([[-0.07,  0.  ],
           [ 0.  , -0.11]], dtype=float32)
    >>> optim.Muon(ns_coeffs="dion", steps=3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: Muon: steps=3 disagrees with the 5 per-step ns_coeffs ...
    """

    lr: Hyper = nonneg(0.02)
    rho: Hyper = unit(0.95)
    eps: Hyper = nonneg(1e-8)
    weight_decay: Hyper = nonneg(0.0)
    consistent_rms: Hyper | None = nonneg(None)
    nesterov: bool = flag(True)
    adaptive: bool = flag(False)
    steps: int | None = static(None)
    reduction_axis: Any = static(0)
    output_axis: Any = static(None)
    mu_dtype: Any = static(None)
    ns_coeffs: Any = static("standard")
    preconditioning: str = static("frobenius")

    def init(self, x):
        self._matrix(x.shape)
        return MuonState(mu_zeros(self, x), jnp.zeros((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        mu, u, count = self._direction(state, x, dx)
        u, split = _whole(u)
        o, back = self._orthogonal(u, x)
        o = back(o)
        if self.adaptive:
            o = jnp.sum(jnp.conj(u) * o) * o
        if split is not None:      # back to the momentum's sharding: a local slice, no communication
            o = jax.sharding.reshard(o, split)
        c = lambda v: as_compute(v, x)   # noqa: E731
        step = c(self.lr) * (self._scale(x) * o + c(self.weight_decay) * x)
        return MuonState(store((mu,), (state.mu,))[0], count), step


@register_for_export
class NorMuonState(NamedTuple):
    mu: Any              # the momentum
    nu: Any              # each output neuron's second moment: the parameter's shape, reduction axes of size 1
    count: Small         # the parameter's number of steps, int32


class NorMuon(_Matrix):
    """NorMuon (Li et al. 2025): Muon's orthogonalised momentum, each output neuron's weights (a column of `W`
    for `x @ W`, a row of PyTorch's (out, in) weight) normalised by a running second moment of them. With `O`
    Muon's orthogonalised direction (`Muon`'s first two points, the same `ns_coeffs`, `preconditioning` and
    axes), per matrix of the batch:

    - `ν ← β₂ ν + (1 - β₂) mean_i |O_ij|²`, one number per output neuron `j` (the mean over the reduction
      axes `i`: the neuron's fan-in);
    - `Ô = O / (√ν + ε)` (each neuron's row divided by its RMS), then `Ô ← Ô ‖O‖_F / ‖Ô‖_F`: rescaled to
      Muon's update norm, so the step's RMS is Muon's (0 where `O = 0`);
    - `step = η (s Ô + λ x)` with Muon's shape scale `s` (`√max(1, fan_out / fan_in)`, or
      `r √max(fan_in, fan_out)` with `consistent_rms`).

    ν is not bias-corrected: a common factor of every neuron's ν cancels in the rescaling (up to ε).
    Vectors and scalars are a `TypeError` at `setup`, as for `Muon`: give them another rule.

    Args:
        lr: learning rate η, default 0.02, >= 0.
        rho: momentum β, default 0.95, in [0, 1).
        beta2: β₂, the decay of the neurons' second moment, default 0.95, in [0, 1).
        eps: ε added to `√ν`, and to the norm that scales the momentum before the iteration (as `Muon`'s),
            default 1e-8, >= 0.
        weight_decay: λ, decoupled, multiplied by η, default 0.0, >= 0.
        consistent_rms: r, default None (the width scale); a number >= 0 selects the consistent-RMS scale
            (structural between None and a number; the number is adjustable).
        nesterov: the Nesterov direction (else the bias-corrected momentum), default True (structural).
        steps, reduction_axis, output_axis, mu_dtype, ns_coeffs, preconditioning: as `Muon`'s (structural).

    State: `NorMuonState(mu, nu, count)`: the momentum `m` (starting at 0), the second moments `ν` (shaped like
    the parameter with the reduction axes of size 1, in its real dtype, starting at 0) and the parameter's
    number of steps (int32). Counts are per parameter: one with no step keeps its `t`.

    Reference: Z. Li, L. Liu, C. Liang, W. Chen, T. Zhao, "NorMuon: Making Muon more efficient and scalable",
    2025, https://arxiv.org/abs/2510.05491 (Algorithm 1), and its code, https://github.com/zichongli5/NorMuon,
    whose rescaling to Muon's update norm is the one here.

    optax: no counterpart in optax 0.2.8 (`optax.contrib.normuon` is proposed, unmerged). Differences from the
    paper's code: Muon's direction is optax's (`Muon`: the Nesterov momentum bias-corrected; the paper's code
    uses `β m + (1 - β) g` uncorrected, the same up to the first steps' weights), ε is the rule's (the code's
    NS adds 1e-7 and its normalisation 1e-10), and the neurons are the output axes (`x @ W`, W of shape
    (in, out)); PyTorch's `Linear` weight is (out, in), where its rows are the neurons.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.zeros((2, 2))
    >>> state = optim.setup(optim.NorMuon(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([[3.0, 0.0], [0.0, 4.0]]))
    >>> # Muon's O has columns of norms 0.72 and 1.12; after the normalisation both
    >>> # columns have the same norm, and together Muon's
    >>> x.round(3)
    Array([[-0.094,  0.   ],
           [ 0.   , -0.094]], dtype=float32)
    """

    lr: Hyper = nonneg(0.02)
    rho: Hyper = unit(0.95)
    beta2: Hyper = unit(0.95)
    eps: Hyper = nonneg(1e-8)
    weight_decay: Hyper = nonneg(0.0)
    consistent_rms: Hyper | None = nonneg(None)
    nesterov: bool = flag(True)
    steps: int | None = static(None)
    reduction_axis: Any = static(0)
    output_axis: Any = static(None)
    mu_dtype: Any = static(None)
    ns_coeffs: Any = static("standard")
    preconditioning: str = static("frobenius")

    def init(self, x):
        _, red, _ = self._matrix(x.shape)
        nu = jnp.zeros(tuple(1 if a in red else n for a, n in enumerate(x.shape)), real_dtype(x))
        return NorMuonState(mu_zeros(self, x), nu, jnp.zeros((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        c = lambda v: as_compute(v, x)   # noqa: E731
        mu, u, count = self._direction(state, x, dx)
        u, split = _whole(u)
        o, back = self._orthogonal(u, x)                          # (batch, fan_in, fan_out)
        (nu,) = load(x, state.nu)
        nu, nu_split = _whole(nu)
        batch, red, out = self._matrix(x.shape)
        order = batch + red + out
        nu3 = nu.transpose(order).reshape(o.shape[0], 1, o.shape[2])
        beta2 = c(self.beta2)
        nu3 = beta2 * nu3 + (1 - beta2) * jnp.mean(abs2(o), axis=1, keepdims=True)
        normed = o / (jnp.sqrt(nu3) + c(self.eps))
        size = lambda a: jnp.sqrt(jnp.sum(abs2(a), axis=(1, 2), keepdims=True))   # noqa: E731
        n_o, n_normed = size(o), size(normed)
        # ‖Ô‖ = 0 only where O = 0: keep the zero step there rather than 0/0
        o = normed * jnp.where(n_normed > 0, n_o / jnp.where(n_normed > 0, n_normed, 1), 0)
        o = back(o)
        if split is not None:      # back to the momentum's sharding: a local slice, no communication
            o = jax.sharding.reshard(o, split)
        nu = nu3.reshape(tuple(nu.shape[a] for a in order)).transpose(np.argsort(order))
        if nu_split is not None:
            nu = jax.sharding.reshard(nu, nu_split)
        step = c(self.lr) * (self._scale(x) * o + c(self.weight_decay) * x)
        return NorMuonState(store((mu,), (state.mu,))[0], nu.astype(state.nu.dtype), count), step
