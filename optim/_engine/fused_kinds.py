"""The fused CPU kernel's kinds (`optim/_engine/fused.cc`): which rule each one runs, the state it reads, and
the per-member scalars XLA computes for it (hyperparameters, bias corrections, the wrappers' numbers).

A rule runs as a kind when its own class declares the formula (`Rule._formula`, see `kind_of`); its state is
`ARRAYS[kind]` arrays of the parameter's shape, then `PACKED[kind]` small leaves kept in packs (the Adam family's
products (β₁ᵗ, β₂ᵗ) of the bias correction, RAdam's and ADOPT's step numbers), whose new values are written as
pack rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .pack import PackRows
from .stack import row_index
from .._rules.adam import nadam_factors, rectification
from .._rules.adopt import clip_bound
from .._rules.moments import bt_next, debias
from .._rules.protocol import as_compute, eps_of, formula_of

__all__ = ["ARRAYS", "PACKED", "kind_of", "scalars"]

(_ADAM, _ADAMW_COUPLED, _ADAMW, _LION, _MOMENTUM, _DESCENT, _NADAM, _ADABELIEF, _RMSPROP, _RMSPROP_CENTRED, _AMSGRAD,
 _RADAM, _ADOPT, _ADOPT_NESTEROV, _ADEMAMIX) = range(15)
CENTRED_RMSPROP = _RMSPROP_CENTRED   # its bfloat16 state holds the variance, which the kernel does not compute
# States (arrays, then packed (∏β₁, ∏β₂) [, t]).
ADAMS = (_ADAM, _ADAMW_COUPLED, _ADAMW, _NADAM, _ADABELIEF, _RADAM, _ADEMAMIX)
# The state arrays per kind (a third has the second's dtype: AMSGrad's maximum, AdEMAMix's v).
ARRAYS = {_LION: 1, _MOMENTUM: 1, _DESCENT: 0, _RMSPROP: 1, _RMSPROP_CENTRED: 2, _ADOPT: 2, _ADOPT_NESTEROV: 2,
          **dict.fromkeys(ADAMS, 2), _AMSGRAD: 3, _ADEMAMIX: 3}
# The packed leaves after the arrays: (∏β₁, ∏β₂), and RAdam's and ADOPT's t.
PACKED = {**dict.fromkeys(ARRAYS, 0), **dict.fromkeys(ADAMS, 1), _RADAM: 2, _ADOPT: 1, _ADOPT_NESTEROV: 1}


def kind_of(rule: Any) -> int | None:
    """The kernel's kind for `rule`'s formula (see `Rule._formula`), or None where the kernel has none."""
    kind = _KINDS.get(formula_of(rule))
    return kind if not isinstance(kind, tuple) else kind[1] if getattr(rule, kind[2]) else kind[0]


# Per formula its kind, or (kind, kind where the rule's structural flag is set, the flag).
_KINDS = {"adam": _ADAM, "lion": _LION, "momentum": _MOMENTUM, "descent": _DESCENT, "nadam": _NADAM,
          "adabelief": _ADABELIEF, "amsgrad": _AMSGRAD, "radam": _RADAM, "adamw": (_ADAMW, _ADAMW_COUPLED, "couple"),
          "rmsprop": (_RMSPROP, _RMSPROP_CENTRED, "centred"), "adopt": (_ADOPT, _ADOPT_NESTEROV, "nesterov"),
          "ademamix": _ADEMAMIX}


# Per formula the rule's field of decay rates ("beta": (β₁, β₂); "rho": ρ, in b1; None) and whether it has an ε.
_HYPERS = {"adam": ("beta", True), "adamw": ("beta", True), "nadam": ("beta", True), "adabelief": ("beta", True),
           "amsgrad": ("beta", True), "radam": ("beta", True), "adopt": ("beta", True), "lion": ("beta", False),
           "rmsprop": ("rho", True), "momentum": ("rho", False), "descent": (None, False), "ademamix": ("beta", True)}


def scalars(kind: int, plan: Any, x: jax.Array, call: list, flat: list, packs: tuple, scale: jax.Array,
            ok: jax.Array | None) -> tuple:
    """The `(members, 16)` float32 scalars of one call of `plan` (optim._engine.fused's `_Plan`; `x`: a member's
    parameter, for the compute dtype; `call`: its members `(stack, member, row)`; `flat`: per stack its state's
    leaves; `scale`: the clip factor), see optim/_engine/fused.cc, and the new packed leaves (the Adam family's
    powers, RAdam's and ADOPT's t) as pack rows: `[(group, leaf, rows of the pack, values)]` (the old ones where
    `ok`, a flag per member, is false)."""
    rule, writes = plan.core, []
    # lr, then the formula's decay rates (b1, b2; ρ in b1) and ε; the rest 0 unless set below.
    field, has_eps = _HYPERS[formula_of(rule)]
    rates = () if field is None else getattr(rule, field) if field == "beta" else (getattr(rule, field),)
    col = {"lr": as_compute(rule.lr, x), **{k: as_compute(v, x) for k, v in zip(("b1", "b2"), rates)}}
    if has_eps:
        col["eps"] = eps_of(rule.eps, x)
    # The clip factor, the chain's last Scale (the step times f), an EMA's decay (its average is float32), the gate.
    col.update(gs=scale, f=as_compute(plan.scale.f, x) if plan.scale is not None else 1.0,
               d=plan.ema.decay if plan.ema is not None else 0.0, ok=1.0 if ok is None else ok)
    if kind in ADAMS:
        b1, b2 = col["b1"], col["b2"]
        def powers(bt):     # the products of the β's with this step's (see optim._rules.moments.bt_init)
            return bt_next(bt, (b1, b2), x)
        _, bt, writes = _pack_step(call, flat, packs, ARRAYS[kind], powers, ok)
        bt = bt.astype(jnp.float32)
        col.update(zip(("c1", "c2"), debias(bt.T)))
        if kind in (_ADAMW, _ADAMW_COUPLED, _ADEMAMIX):
            col["wd"] = as_compute(rule.weight_decay, x)
        if kind == _ADEMAMIX:    # the slow moment's weight and decay
            col.update(k2=as_compute(rule.alpha, x), b3=as_compute(rule.beta3, x))
        if kind == _NADAM:       # NAdam's factors of m, of g and of v
            col.update(zip(("c1", "k2", "c2"), nadam_factors(b1, b2, bt.T)))
        if kind == _RADAM:       # RAdam's rectification r (in k2), and whether this step is rectified
            t, _, more = _pack_step(call, flat, packs, 3, lambda t: t + 1, ok)
            writes += more
            col.update(zip(("k2", "flag"), rectification(b2, t, bt[:, 1])))
    elif kind in (_ADOPT, _ADOPT_NESTEROV):     # ADOPT's clip t^¼ (inf: none), and whether it is the first step
        t, _, writes = _pack_step(call, flat, packs, 2, lambda t: t + 1, ok)
        col.update(c1=clip_bound(t, col["b1"].dtype) if rule.use_clipping else jnp.inf, flag=t == 0)
    # The matrix from a few pieces: each run of columns that are one number for all members is one broadcast
    # vector (XLA:CPU fuses a concatenation of a few pieces into one loop, not of 16 columns).
    k, pieces = len(call), []
    for name in _COLUMNS:
        v = jnp.asarray(col.get(name, 0.0), jnp.float32)
        if v.ndim == 0 and pieces and isinstance(pieces[-1], list):
            pieces[-1].append(v)
        else:
            pieces.append([v] if v.ndim == 0 else v[:, None])
    return jnp.concatenate([jnp.broadcast_to(jnp.stack(p), (k, len(p))) if isinstance(p, list) else p
                            for p in pieces], axis=1), writes


# The columns of the kernel's scalars (optim/_engine/fused.cc's Scalars16).
_COLUMNS = ("lr", "b1", "b2", "eps", "c1", "c2", "wd", "gs", "f", "d", "ok", "k2", "flag", "b3", "", "")


def _pack_step(call: list, flat: list, packs: tuple, j: int, new: Any, ok: jax.Array | None) -> tuple:
    """The call's members' values of their packed state leaf `j` (their rows of the packs, read per pack group, in
    call order), their new values `new(old)` in the same order, and those as pack rows (`PackRows`; the old ones
    where `ok`, a flag per member, is false: a skipped step keeps its state)."""
    runs, olds, news, writes, at = [], [], [], [], 0
    for i, _, r in call:
        p = flat[i][0][j]
        if runs and runs[-1][0] == (p.group, p.leaf):
            runs[-1][1].append(p.start + r)
        else:
            runs.append(((p.group, p.leaf), [p.start + r]))
    for (group, leaf), rows in runs:
        old = packs[group][leaf][row_index(tuple(rows))]
        olds.append(old)
        values = new(old)
        news.append(values)
        if ok is not None:
            values = jnp.where(ok[at:at + len(rows)].reshape((-1,) + (1,) * (old.ndim - 1)), values, old)
        at += len(rows)
        writes.append(PackRows(group=group, leaf=leaf, rows=tuple(rows), values=values))
    def joined(parts):
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    return joined(olds), joined(news), writes
