"""Hoisting: a rule's per-parameter scalar arithmetic, run once for a whole pack of parameters.

Adam's step for one parameter mixes two kinds of work: arithmetic over arrays shaped like the parameter (the
moments, the step) and arithmetic over a few numbers (the bias corrections `1 / (1 - βᵗ)`, the next powers
`βᵗ⁺¹`, the hyperparameters in the compute dtype). Run per parameter, the second kind costs XLA a few tiny
kernels per parameter (a division is not duplicated into the element loop that reads it), which on a model of
1000 large parameters doubles the program (optax computes them once from one shared count).

`split` cuts the traced per-parameter `apply` in two by data dependence: the *known* part reads only the
hyperparameters and the packed small state leaves (`optim._pack`); the *unknown* part reads the parameter,
its gradients and the state leaves shaped like it. `run` evaluates the known part once per pack group, vmapped
over all its rows (a handful of kernels for up to `PACK_MAX_ROWS` parameters), and each stack's unknown part
vmapped over its members, with the known values it needs (the residuals) sliced per row: a slice and a multiply
fuse into the element loop. The result is exactly the `apply` it came from, reordered.

Known arithmetic whose result is shaped like the parameter and depends on the state stays in the unknown
part (it would otherwise be materialised per row); so does anything with side effects. A rule whose jaxpr
cannot be split (or a sharded computation, whose avals carry shardings) runs as before.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._cache import LRU
from ._pack import SMALL, is_packed
from ._stack import row_index

__all__ = ["run", "ENABLED"]

# Off: every stack runs its rule as a whole, reading its packed rows (the reference the tests compare with).
ENABLED = True


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    known: Any                 # ClosedJaxpr: (rule leaves, small leaves) -> (known outputs, residuals)
    unknown: Any               # ClosedJaxpr: (residuals, wide leaves, x, dxs) -> unknown outputs
    out_known: tuple           # per output of the apply: computed by the known part?
    batched: tuple             # per output of the known part: does it depend on the small leaves (per row)?
    key: str                   # the known part's text: stacks with equal keys share one evaluation
    out_def: Any               # treedef of (new state, step)


# Per (rule structure, avals): a model has a few hundred distinct parameter kinds at most.
_SPLITS = LRU(1024)


def _aval(a: Any) -> jax.ShapeDtypeStruct:
    t = jax.typeof(a)
    return jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type)


def _split(rule: Any, state_def: Any, small_at: tuple, smalls: list, wides: list, x: Any, dxs: tuple):
    """The split of `rule.apply` for one parameter (avals per member), or None when it cannot be split."""
    rule_leaves, rule_def = jax.tree_util.tree_flatten(rule)
    n_rule, n_small = len(rule_leaves), len(smalls)
    out_def = []

    def member(*args):
        r = jax.tree_util.tree_unflatten(rule_def, args[:n_rule])
        small, rest = args[n_rule:n_rule + n_small], list(args[n_rule + n_small:])
        leaves, k = [], 0
        for i in range(state_def.num_leaves):
            if i in small_at:
                leaves.append(small[small_at.index(i)])
            else:
                leaves.append(rest[k])
                k += 1
        state = jax.tree_util.tree_unflatten(state_def, leaves)
        xx, dd = rest[k], rest[k + 1:]
        out, treedef = jax.tree_util.tree_flatten(type(r).apply(r, state, xx, *dd) if hasattr(type(r), "apply")
                                                  else r.apply(state, xx, *dd))
        out_def.append(treedef)
        return out

    avals = [_aval(a) for a in rule_leaves] + list(smalls) + list(wides) + [x, *dxs]
    try:
        closed = jax.make_jaxpr(member)(*avals)
    except Exception:      # let the ordinary path raise the rule's own error, with its context
        return None
    j = closed.jaxpr
    if j.effects:
        return None
    from jax.extend.core import Literal

    ins = j.invars
    known = set(ins[:n_rule + n_small]) | set(j.constvars)
    batched = set(ins[n_rule:n_rule + n_small])
    k_eqns, u_eqns = [], []
    for e in j.eqns:
        vs = [v for v in e.invars if not isinstance(v, Literal)]
        if not e.effects and all(v in known for v in vs):
            b = any(v in batched for v in vs)
            if not b or all(math.prod(o.aval.shape) <= SMALL for o in e.outvars):
                k_eqns.append(e)
                known.update(e.outvars)
                if b:
                    batched.update(e.outvars)
                continue
        u_eqns.append(e)
    out_known = tuple(isinstance(v, Literal) or v in known for v in j.outvars)
    if all(out_known) or not any(out_known) and not k_eqns:
        return None          # nothing to hoist
    res: list = []
    seen: set = set()
    for e in u_eqns:
        for v in e.invars:
            if not isinstance(v, Literal) and v in known and v not in seen and v not in j.constvars:
                seen.add(v)
                res.append(v)
    for v in (v for v, k in zip(j.outvars, out_known) if not k):
        if not isinstance(v, Literal) and v in known and v not in seen and v not in j.constvars:
            seen.add(v)
            res.append(v)
    known_outs = [v for v, k in zip(j.outvars, out_known) if k]
    kj = j.replace(invars=list(ins[:n_rule + n_small]), outvars=known_outs + res, eqns=k_eqns,
                   debug_info=None)
    uj = j.replace(invars=res + list(ins[n_rule + n_small:]), outvars=[v for v, k in zip(j.outvars, out_known)
                                                                      if not k], eqns=u_eqns, debug_info=None)
    known_closed = jax.extend.core.ClosedJaxpr(kj, closed.consts)
    unknown_closed = jax.extend.core.ClosedJaxpr(uj, closed.consts)
    flags = tuple(not isinstance(v, Literal) and v in batched for v in known_outs + res)
    key = str(kj) + repr([id(c) for c in closed.consts])
    return Split(known_closed, unknown_closed, out_known, flags, key, out_def[0])


def _stored_form(stored: Any, wides: list) -> Any:
    """`stored` (a stack's stored tree) with its array leaves replaced by `wides`, placeholders kept."""
    leaves, treedef = jax.tree_util.tree_flatten(stored, is_leaf=is_packed)
    it = iter(wides)
    return treedef.unflatten([a if is_packed(a) else next(it) for a in leaves])


def _sharded(a: Any) -> bool:
    s = getattr(jax.typeof(a), "sharding", None)
    return s is not None and not s.mesh.empty


def run(rule: Any, stored: list, rows: list, sizes: list, xs: list, dxs: list, packs: tuple):
    """Run `rule` on stacks whose small leaves are packed, hoisting the small arithmetic.

    Per stack `i`: `stored[i]` its stored tree (with `Packed` placeholders), `rows[i]` its stepping rows,
    `sizes[i]` its number of members, `xs[i]` / `dxs[i]` the stepping rows' parameters and gradients.
    Returns `(results, pack_rows)`: per stack `(new stored tree rows, step)` or None where it was not hoisted
    (the caller runs it as usual), and `[(group, leaf, rows in the pack, new values)]` for the packs."""
    results: list = [None] * len(stored)
    small_ats: dict = {}
    plans = []
    rule_leaves = jax.tree.leaves(rule)
    try:
        rule_avals = tuple(_aval(a) for a in rule_leaves)
    except TypeError:        # a rule that is not a pytree of numbers (a user's object): run it as it is
        return results, []
    if any(_sharded(a) for a in rule_leaves):
        return results, []
    for i, tree in enumerate(stored):
        leaves, state_def = jax.tree_util.tree_flatten(tree, is_leaf=is_packed)
        small_at = tuple(k for k, a in enumerate(leaves) if is_packed(a))
        if not small_at or len({leaves[k].group for k in small_at}) != 1:
            continue
        wides = [a for a in leaves if not is_packed(a)]
        if any(_sharded(a) for a in wides + [xs[i], *dxs[i]]):
            continue
        group = leaves[small_at[0]].group
        smalls = [jax.ShapeDtypeStruct(np.shape(packs[group][leaves[k].leaf])[1:],
                                       packs[group][leaves[k].leaf].dtype) for k in small_at]
        member = [jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype) for a in wides + [xs[i], *dxs[i]]]
        key = (jax.tree.structure(rule), state_def, small_at, tuple(smalls), tuple(member), rule_avals)
        sp = _SPLITS.get(key)
        if sp is None:
            sp = _split(rule, state_def, small_at, smalls, member[:len(wides)], member[len(wides)],
                        tuple(member[len(wides) + 1:]))
            _SPLITS[key] = sp if sp is not None else False
        if not sp:
            continue
        pack_rows = tuple(leaves[small_at[0]].start + r for r in rows[i])
        if sp.out_def.num_leaves < state_def.num_leaves or jax.tree.structure(
                jax.tree_util.tree_unflatten(sp.out_def, [0] * sp.out_def.num_leaves)[0]) != state_def:
            continue         # the rule returns a state of another structure: not ours to rearrange
        small_ats[i] = small_at
        plans.append((i, sp, group, [leaves[k] for k in small_at], pack_rows, wides, state_def))

    # The known parts: one vmapped evaluation per pack group and equal known part, over the stepping rows.
    chunks: dict = {}
    for p in plans:
        chunks.setdefault((p[2], p[1].key), []).append(p)
    pack_rows: list = []
    for (group, _), members in chunks.items():
        sp = members[0][1]
        all_rows = sum((p[4] for p in members), ())
        ix = row_index(all_rows)
        holders = members[0][3]
        smalls = [packs[group][h.leaf][ix] for h in holders]
        fn = jax.extend.core.jaxpr_as_fun(sp.known)
        outs = jax.vmap(lambda *a: fn(*a), in_axes=(None,) * len(rule_leaves) + (0,) * len(smalls),
                        out_axes=[0 if b else None for b in sp.batched])(*rule_leaves, *smalls)
        n_out = sum(sp.out_known)
        known_outs, res = list(outs[:n_out]), list(outs[n_out:])
        # Flat output k of the apply is state leaf k (the state comes first); `whole[k]` is 1 + its index among
        # the known outputs when the known part computes it per row, else 0.
        known_index = np.cumsum(sp.out_known) - 1
        whole = [int(known_index[k]) + 1 if sp.out_known[k] and sp.batched[known_index[k]] else 0
                 for k in range(len(sp.out_known))]
        at = 0
        for i, sp_i, _, holders_i, rows_i, wides, state_def in members:
            m = len(rows_i)
            cut = slice(at, at + m)
            at += m
            r_in = [r[cut] if b else r for r, b in zip(res, sp.batched[n_out:])]
            take = row_index(rows[i])
            wide_rows = [a if len(rows[i]) == sizes[i] else a[take] for a in wides]
            b_res = [0 if b else None for b in sp.batched[n_out:]]
            ufn = jax.extend.core.jaxpr_as_fun(sp_i.unknown)
            u_outs = jax.vmap(lambda *a: ufn(*a), in_axes=b_res + [0] * (len(wide_rows) + 1 + len(dxs[i])))(
                *r_in, *wide_rows, xs[i], *dxs[i])
            u_iter, k_iter = iter(u_outs), iter(zip(known_outs, sp.batched[:n_out]))
            flat = []
            for kn in sp_i.out_known:
                if kn:
                    v, b = next(k_iter)
                    flat.append(v[cut] if b else jnp.broadcast_to(v, (m,) + jnp.shape(v)))
                else:
                    flat.append(next(u_iter))
            new_state, step = jax.tree_util.tree_unflatten(sp_i.out_def, flat)
            new_leaves = jax.tree.leaves(new_state)
            stored_new = list(wides)
            w = 0
            for k in range(state_def.num_leaves):
                if k in small_ats[i]:
                    h = holders_i[small_ats[i].index(k)]
                    if not whole[k]:
                        pack_rows.append((group, h.leaf, rows_i, new_leaves[k]))
                else:
                    stored_new[w] = new_leaves[k]
                    w += 1
            results[i] = (_stored_form(stored[i], stored_new), step)
        # New packed leaves computed by the known part for every row alike: one array for the whole chunk.
        for k in small_ats[members[0][0]]:
            if whole[k]:
                h = holders[small_ats[members[0][0]].index(k)]
                pack_rows.append((group, h.leaf, all_rows, known_outs[whole[k] - 1]))
    return results, pack_rows
