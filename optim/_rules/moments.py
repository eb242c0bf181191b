"""Moments: how rules store running averages of gradients.

- Storage dtypes (`mu_dtype`, `nu_dtype`): the Adam family (Adam, AdamW, NAdam, RAdam, AMSGrad, AdaBelief),
  ADOPT, AdEMAMix (`mu_dtype` for both its first moments) and RMSProp (`nu_dtype` for `q`, `mu_dtype` for the
  centred `l`) take both, Lion, Momentum, Muon and Adafactor take `mu_dtype`. They are real floating dtypes,
  `Quantized` formats (8 or 4 bits a number, blockwise: `optim._rules.quantized`) or None (the default: the
  parameter's dtype, its real dtype for second moments), structural (a dtype changes the program, `adjust`
  refuses it), and checked when the rule is built. `load` reads a stored moment in the wider of its dtype and
  the compute dtype (a bfloat16 moment is updated in float32, a float64 run is not truncated); rules compute the
  step from the unrounded new moments and `store` rounds them to their storage dtype (as optax's `mu_dtype`).
  A complex parameter's first moment is complex: `mu_dtype` float32 / float64 stores it as complex64 /
  complex128; a 16-bit `mu_dtype` has no complex counterpart and is a `TypeError` at `setup`.
- Adam's moment updates and the products `(∏β₁, ∏β₂)` of its bias correction (`β₁ᵗ`, `β₂ᵗ` for constant β).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .protocol import abs2, compute_dtype, inner_rules, pair_of, real_dtype, tuple_of
from .quantized import Quantized, QuantizedArray, quantize

__all__ = ["StateDtypes", "dtype_arg", "mu_zeros", "nu_zeros", "load", "store", "moments", "bt_init", "bt_next",
           "debias"]


# ----------------------------------------------------------------------------------------------- storage dtypes
COMPLEX_OF = {jnp.dtype(jnp.float32): jnp.dtype(jnp.complex64), jnp.dtype(jnp.float64): jnp.dtype(jnp.complex128)}


def dtype_arg(owner: str, name: str, v: Any) -> Any:
    """A `mu_dtype` / `nu_dtype` argument in stored form: None, a `Quantized` format, or a real floating
    `jnp.dtype`."""
    if v is None or isinstance(v, Quantized):
        return v
    try:   # a dtype, a scalar type (jnp.bfloat16) or a name ("bfloat16"); not an array, whose dtype jnp.dtype reads
        d = jnp.dtype(v) if isinstance(v, (np.dtype, type, str)) else None
    except (TypeError, ValueError):
        d = None
    if d is None or not jnp.issubdtype(d, jnp.floating):
        raise TypeError(f"{owner}: {name} must be a real floating dtype (jnp.bfloat16, jnp.float32, ...), a "
                        f"Quantized format (optim.q8, optim.q4) or None, got {v!r}")
    return d


class StateDtypes:
    """Mixin of the rules with `mu_dtype` (and `nu_dtype`) fields: checks them at construction."""

    def __post_init__(self):
        super().__post_init__()
        for name in ("mu_dtype", "nu_dtype"):
            if hasattr(self, name):
                object.__setattr__(self, name, dtype_arg(type(self).__name__, name, getattr(self, name)))


def mu_zeros(rule: Any, x: jax.Array, fill: Any = 0) -> Any:
    """A first moment of `x` filled with `fill`, in `rule.mu_dtype` (default: `x`'s dtype); for a complex `x`,
    the complex dtype of `mu_dtype`'s precision; a `QuantizedArray` (signed map) where `mu_dtype` is a
    `Quantized` format and `x` is large enough (`Quantized.min_size`)."""
    d = _format_for(rule, "mu_dtype", x)
    if isinstance(d, Quantized):
        return quantize(jnp.full(x.shape, fill, compute_dtype(x)), d, signed=True)
    if d is not None and jnp.iscomplexobj(x):
        if d not in COMPLEX_OF:
            raise TypeError(f"{type(rule).__name__}: mu_dtype={d.name} cannot hold the first moment of a complex "
                            f"parameter ({jnp.dtype(x.dtype).name}): there is no complex {d.name}; use float32, "
                            "float64 or None")
        d = COMPLEX_OF[d]
    return jnp.full_like(x, fill, dtype=d)


def nu_zeros(rule: Any, x: jax.Array, fill: Any = 0) -> Any:
    """A second moment of `x` filled with `fill`, in `rule.nu_dtype` (default: `x`'s real dtype); a
    `QuantizedArray` (unsigned map) where `nu_dtype` is a `Quantized` format and `x` is large enough."""
    d = _format_for(rule, "nu_dtype", x)
    if isinstance(d, Quantized):
        return quantize(jnp.full(x.shape, fill, compute_dtype(x)), d, signed=False)
    return jnp.full(x.shape, fill, real_dtype(x) if d is None else d)


def _format_for(rule: Any, name: str, x: jax.Array) -> Any:
    """`rule`'s storage option `name` for `x`: a `Quantized` format becomes None (the default storage) for a
    parameter smaller than its `min_size`, and is a `ValueError` for a complex one."""
    d = getattr(rule, name)
    if not isinstance(d, Quantized):
        return d
    if x.size < d.min_size:
        return None
    if jnp.iscomplexobj(x):
        raise ValueError(f"{type(rule).__name__}: {name}={d!r} cannot store the moments of a complex parameter "
                         f"({jnp.dtype(x.dtype).name}, {x.size} numbers): its codes are real; give this parameter "
                         "another rule with optim.by_path, or a float dtype")
    return d


def load(x: jax.Array, *moments: Any) -> tuple:
    """Stored moments in the dtype to compute with: the wider of their own and `x`'s compute dtype (a
    `QuantizedArray` dequantised to float32 first)."""
    c = compute_dtype(x)
    moments = tuple(a.dequantize() if isinstance(a, QuantizedArray) else a for a in moments)
    return tuple(a.astype(jnp.promote_types(a.dtype, c)) for a in moments)


def store(new: tuple, old: tuple) -> tuple:
    """New moments rounded to the storage of the old ones: their dtype, or their `Quantized` format."""
    return tuple(quantize(n, o.fmt, o.signed) if isinstance(o, QuantizedArray) else n.astype(o.dtype)
                 for n, o in zip(new, old))


# ----------------------------------------------------------------------------------------------- Adam moments
def moments(beta, m, v, dx, x):
    """Adam's moment updates: `(β₁ m + (1 - β₁) g, β₂ v + (1 - β₂)|g|²)`."""
    b1, b2 = pair_of(beta, x)
    return b1 * m + (1 - b1) * dx, b2 * v + (1 - b2) * abs2(dx)


def bt_init(beta, x):
    """The products (∏β₁, ∏β₂, ...) of the decay rates of the steps taken so far, 1 each before the first, as
    one array (as many as `beta` has): one buffer and one kernel per parameter, not one per rate. Each step
    multiplies in its own β first (`bt_next`), so that a step's bias correction is `1 - ∏β`, the weight its
    moment's average has put on gradients so far: `1 - βᵗ` for a constant β, and still exact where β changes
    (a schedule, or `adjust`)."""
    return jnp.ones((len(beta),), compute_dtype(x))


def debias(bt):
    """The bias corrections as factors, `(1 / (1 - bt₁), 1 / (1 - bt₂), ...)`, one per decay rate. Rules
    multiply by them rather than divide: XLA rewrites a division by a broadcast number into this
    multiplication anyway, and written so the factors are per-parameter numbers that `update` computes for a
    whole pack of parameters at once (`optim._engine.hoist`), not one tiny kernel each."""
    return tuple(1 / (1 - bt[k]) for k in range(len(bt)))


def bt_next(bt, beta, x):
    """The products of the decay rates with this step's: what the step's bias correction uses, and stores.

    The maximum with 0 changes no value (both factors are >= 0); it keeps the product rounded before the
    correction subtracts it from 1: XLA contracts `1 - bt β` into one multiply-add where both sit in one fused
    loop (and drops an optimization barrier between them), so the same step would round differently in
    different programs (XLA's path, the fused CPU kernel's scalars), by an ulp of `1 - bt₂`: 1e-5 of a step."""
    return jnp.maximum(bt * jnp.stack(tuple_of(beta, x)).astype(bt.dtype), 0)


# ----------------------------------------------------------------------------------------------- old files
def powers_from_next(rule: Any, state: Any) -> Any:
    """`state` (of `rule`, for one parameter) with each Adam-family `bt` turned from what files of checkpoint
    format version 2 and older hold, the powers of the *next* step (βᵗ⁺¹ after t steps, β at the start), into
    the products of the steps taken (βᵗ, see `bt_init`): divided by its rule's β (a zero β leaves 0, which
    both forms agree on). The rules are paired with their states in depth-first order (a wrapper's or a
    chain's state holds its inner rules' states in the order of its inner rules); a rule whose β is a schedule
    could not be set up by those versions. Raises `ValueError` where the pairing fails."""
    owners: list = []

    def rules_of(r):
        if hasattr(r, "beta") and _keeps_powers(r):
            owners.append(r)
        for inner in inner_rules(r):
            rules_of(inner)

    rules_of(rule)
    found = [s for s in jax.tree.leaves(state, is_leaf=_has_powers) if _has_powers(s)]
    if len(found) != len(owners):
        raise ValueError(f"{type(rule).__name__}: cannot pair its {len(owners)} rules with bias-correction "
                         f"powers with the {len(found)} such states in the file")
    new = iter(s._replace(bt=jnp.where(b == 0, 0, s.bt / b)) for s, b in
               ((s, jnp.stack(tuple_of(r.beta, s.bt)).astype(s.bt.dtype)) for s, r in zip(found, owners)))
    return jax.tree.map(lambda s: next(new) if _has_powers(s) else s, state, is_leaf=_has_powers)


def _has_powers(s: Any) -> bool:
    return isinstance(s, tuple) and hasattr(s, "_fields") and "bt" in s._fields


def _keeps_powers(rule: Any) -> bool:
    try:
        return _has_powers(jax.eval_shape(rule.init, jax.ShapeDtypeStruct((2, 2), jnp.float32)))
    except Exception:    # noqa: BLE001 (a rule that cannot step a 2x2 matrix keeps no Adam powers for one)
        return False
