"""Hoisting: a rule's per-parameter scalar arithmetic, run once for a whole pack of parameters.

Adam's step for one parameter mixes two kinds of work: arithmetic over arrays shaped like the parameter (the
moments, the step) and arithmetic over a few numbers (the bias corrections `1 / (1 - βᵗ)`, the next powers
`βᵗ⁺¹`, the hyperparameters in the compute dtype). Run per parameter, the second kind costs XLA a few tiny
kernels per parameter (a division is not duplicated into the element loop that reads it), which on a model of
1000 large parameters doubles the program (optax computes them once from one shared count).

`_split` cuts the traced step of one stack (`apply_all` on its stepping rows: the rule's `apply` vmapped, or a
wrapper's `apply_tree`) in two by data dependence: the *known* part reads only the hyperparameters and the
packed small state leaves (`optim._engine.pack`); the *unknown* part reads the parameters, their gradients and the
state leaves shaped like them. `run` evaluates the known part once for all the stacks of a pack group whose
known parts are equal (the same computation on other rows: in practice, stacks with the same number of stepping
rows), vmapped over those stacks (a handful of kernels for up to `PACK_MAX_ROWS` parameters), and each stack's
unknown part as it is, with the known values it needs (the residuals) sliced per stack: a slice and a multiply
fuse into the element loop. The result is exactly the step it came from, reordered.

Known arithmetic whose result is larger than `SMALL` numbers per parameter and depends on the state stays in the
unknown part (it would otherwise be materialised per stack); so does anything with side effects. A rule whose jaxpr
cannot be split (or a sharded computation, whose avals carry shardings) runs as before, and the `optim` logger
says why at debug level.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, NamedTuple

import jax
import numpy as np

from .._base.cache import LRU
from . import strategies
from .pack import SMALL, PackRows, fill, is_packed, split_rows
from .stack import row_index, take_rows, traced_sharded
from .._rules.protocol import apply_all, looks_across
from .._rules.split import key as split_key
from .._rules.wrappers import OptimiserChain

__all__ = ["step_stacks", "ENABLED"]

# Off: every stack runs its rule as a whole, reading its packed rows (the reference the tests compare with).
ENABLED = True
_log = logging.getLogger("optim")


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    known: Any                 # ClosedJaxpr: (rule leaves, small leaves) -> (known outputs, residuals)
    unknown: Any               # ClosedJaxpr: (residuals, wide leaves, x, dxs) -> unknown outputs
    out_known: tuple           # per output of the step: computed by the known part?
    batched: tuple             # per output of the known part: does it depend on the small leaves?
    key: str                   # the known part's text: stacks with equal keys share one evaluation
    out_def: Any               # treedef of (new state, step)
    same_structure: bool       # the new state has the old one's structure (its leaves are the old ones', in order)


class _Hoisted(NamedTuple):
    """One stack whose step `run` splits: its index among the stacks given, its split, its packed leaves'
    placeholders and their positions among its state's leaves, its stepping rows' rows in the pack group, its
    other state leaves (the stepping rows) and its state's treedef."""

    stack: int
    split: Split
    holders: list              # the `Packed` placeholders of its small leaves, all in one pack group
    small_at: tuple[int, ...]  # their indices among the state's leaves
    in_pack: tuple[int, ...]   # its stepping rows' rows in the pack group's arrays
    wides: list
    state_def: Any


# Per (rule structure, avals): a model has a few hundred distinct parameter kinds at most.
_SPLITS = LRU(1024)


def _aval(a: Any) -> jax.ShapeDtypeStruct:
    t = jax.typeof(a)
    return jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type)


def _named(j: Any, part: str) -> Any:
    """`j` with debug info of its own (JAX deprecates jaxprs without; the original's names no longer fit)."""
    info = jax.extend.core.DebugInfo(f"optim hoist ({part})", "optim._engine.hoist", tuple(f"in{i}" for i in range(
        len(j.invars))), tuple(f"out{i}" for i in range(len(j.outvars))))
    return j.replace(debug_info=info)


def _split(rule: Any, state_def: Any, small_at: tuple, smalls: list, wides: list, x: Any, dxs: tuple,
           rows: int) -> Split | None:
    """The split of one stack's step (avals of its `rows` stepping rows), or None when there is nothing to
    hoist or it cannot be traced."""
    from jax.extend.core import ClosedJaxpr, Literal

    rule_leaves, rule_def = jax.tree_util.tree_flatten(rule)
    n_rule, n_small = len(rule_leaves), len(smalls)
    out_def = []

    def stack_step(*args):
        r = jax.tree_util.tree_unflatten(rule_def, args[:n_rule])
        small, rest = iter(args[n_rule:n_rule + n_small]), iter(args[n_rule + n_small:])
        state = jax.tree_util.tree_unflatten(
            state_def, [next(small) if i in small_at else next(rest) for i in range(state_def.num_leaves)])
        xx = next(rest)
        states, steps = apply_all(r, [state], [xx], [tuple(rest)])
        out, treedef = jax.tree_util.tree_flatten((states[0], steps[0]))
        out_def.append(treedef)
        return out

    try:
        closed = jax.make_jaxpr(stack_step)(*[_aval(a) for a in rule_leaves], *smalls, *wides, x, *dxs)
    except Exception as e:      # the ordinary path raises the rule's own error, with its context
        _log.debug("optim: %s's step is not hoisted (it does not trace on abstract values: %r); each stack runs "
                   "it whole", type(rule).__name__, e)
        return None
    j = closed.jaxpr
    if j.effects:
        _log.debug("optim: %s's step is not hoisted (it has side effects)", type(rule).__name__)
        return None
    ins = j.invars
    known = set(ins[:n_rule + n_small]) | set(j.constvars)
    batched = set(ins[n_rule:n_rule + n_small])
    k_eqns, u_eqns = [], []
    for e in j.eqns:
        vs = [v for v in e.invars if not isinstance(v, Literal)]
        if not e.effects and all(v in known for v in vs):
            b = any(v in batched for v in vs)
            if not b or all(math.prod(o.aval.shape) <= SMALL * rows for o in e.outvars):
                k_eqns.append(e)
                known.update(e.outvars)
                if b:
                    batched.update(e.outvars)
                continue
        u_eqns.append(e)
    out_known = tuple(isinstance(v, Literal) or v in known for v in j.outvars)
    if all(out_known) or not k_eqns:
        return None          # nothing to hoist (or nothing left to run per stack)
    res: list = []
    for v in [v for e in u_eqns for v in e.invars] + [v for v, k in zip(j.outvars, out_known) if not k]:
        if not isinstance(v, Literal) and v in known and v not in res and v not in j.constvars:
            res.append(v)
    known_outs = [v for v, k in zip(j.outvars, out_known) if k]
    kj = _named(j.replace(invars=list(ins[:n_rule + n_small]), outvars=known_outs + res, eqns=k_eqns), "per pack")
    uj = _named(j.replace(invars=res + list(ins[n_rule + n_small:]), eqns=u_eqns,
                          outvars=[v for v, k in zip(j.outvars, out_known) if not k]), "per stack")
    flags = tuple(not isinstance(v, Literal) and v in batched for v in known_outs + res)
    key = str(kj) + repr([id(c) for c in closed.consts])
    new_state = jax.tree_util.tree_unflatten(out_def[0], [0] * out_def[0].num_leaves)[0]
    same = new_state is not None and jax.tree.structure(new_state) == jax.tree.structure(
        jax.tree_util.tree_unflatten(state_def, [0] * state_def.num_leaves))
    return Split(ClosedJaxpr(kj, closed.consts), ClosedJaxpr(uj, closed.consts), out_known, flags, key, out_def[0],
                 same)


def _split_cached(rule: Any, state_def: Any, small_at: tuple, smalls: list, wides: list, x: Any, dxs: tuple,
                  rows: int, rule_avals: tuple) -> Split | None:
    """`_split`, kept in _SPLITS by everything it reads: the rule's structure and hyperparameters' avals, the
    state's structure, the avals, the switches (a step may trace differently under another:
    optim._engine.onepass reads fused's) and the mesh a matrix rule splits its stacks over (optim._rules.split)."""
    key = (jax.tree.structure(rule), state_def, small_at, tuple(smalls), (*wides, x, *dxs), rule_avals,
           strategies.key(), split_key())
    sp = _SPLITS.get(key)
    if sp is None:
        sp = _split(rule, state_def, small_at, smalls, wides, x, dxs, rows)
        _SPLITS[key] = sp if sp is not None else False
    return sp or None


def _stored_form(stored: Any, wides: list) -> Any:
    """`stored` (a stack's stored tree) with its array leaves replaced by `wides`, placeholders kept."""
    leaves, treedef = jax.tree_util.tree_flatten(stored, is_leaf=is_packed)
    it = iter(wides)
    return treedef.unflatten([a if is_packed(a) else next(it) for a in leaves])


def run(rule: Any, stored: list, rows: list, sizes: list, xs: list, dxs: list, packs: tuple):
    """Run `rule` on stacks whose small leaves are packed, hoisting the small arithmetic.

    Per stack `i`: `stored[i]` its stored tree (with `Packed` placeholders), `rows[i]` its stepping rows,
    `sizes[i]` its number of members, `xs[i]` / `dxs[i]` the stepping rows' parameters and gradients.
    Returns `(results, pack_rows)`: per stack `(its stepping rows' new state in stored form, step)`, or None
    where it was not hoisted (the caller runs it as usual), and `[(group, leaf, rows of the pack, new values)]`
    (`PackRows`) for the packs."""
    results: list = [None] * len(stored)
    rule_leaves = jax.tree.leaves(rule)
    try:
        rule_avals = tuple(_aval(a) for a in rule_leaves)
    except TypeError:        # a rule that is not a pytree of numbers (a user's object): run it as it is
        _log.debug("optim: %s's step is not hoisted (a hyperparameter is not a number)", type(rule).__name__)
        return results, []
    if any(traced_sharded(a) for a in rule_leaves):
        _log.debug("optim: %s's step is not hoisted (a sharded hyperparameter)", type(rule).__name__)
        return results, []
    chunks: dict = {}        # (pack group, known part) -> [_Hoisted per stack]
    for i, tree in enumerate(stored):
        leaves, state_def = jax.tree_util.tree_flatten(tree, is_leaf=is_packed)
        small_at = tuple(k for k, a in enumerate(leaves) if is_packed(a))
        if not small_at or len({leaves[k].group for k in small_at}) != 1:
            continue
        m = len(rows[i])
        take = row_index(rows[i])
        wides = [a if m == sizes[i] else a[take] for a in leaves if not is_packed(a)]
        if any(traced_sharded(a) for a in wides + [xs[i], *dxs[i]]):
            _log.debug("optim: %s's step is not hoisted on a sharded stack", type(rule).__name__)
            continue
        holders = [leaves[k] for k in small_at]
        group = holders[0].group
        smalls = [jax.ShapeDtypeStruct((m,) + np.shape(packs[group][h.leaf])[1:], packs[group][h.leaf].dtype)
                  for h in holders]
        sp = _split_cached(rule, state_def, small_at, smalls, [_aval(a) for a in wides], _aval(xs[i]),
                           tuple(_aval(d) for d in dxs[i]), m, rule_avals)
        if not sp or not sp.same_structure:
            continue         # nothing to hoist, or a new state of another structure: not ours to rearrange
        in_pack = tuple(holders[0].start + r for r in rows[i])
        chunks.setdefault((group, sp.key), []).append(_Hoisted(stack=i, split=sp, holders=holders, small_at=small_at,
                                                               in_pack=in_pack, wides=wides, state_def=state_def))

    pack_rows: list = []
    for (group, _), plans in chunks.items():
        # The known part once for these stacks: vmapped over them, each stack's rows of the packs as one entry.
        sp, holders, small_at = plans[0].split, plans[0].holders, plans[0].small_at
        all_rows = sum((p.in_pack for p in plans), ())
        m = len(plans[0].in_pack)
        smalls = [packs[group][h.leaf][row_index(all_rows)] for h in holders]
        smalls = [a.reshape((len(plans), m) + a.shape[1:]) for a in smalls]
        known = jax.extend.core.jaxpr_as_fun(sp.known)
        outs = jax.vmap(lambda *a: known(*a), in_axes=(None,) * len(rule_leaves) + (0,) * len(smalls),
                        out_axes=[0 if b else None for b in sp.batched])(*rule_leaves, *smalls)
        n_out = sum(sp.out_known)
        known_outs, res = outs[:n_out], outs[n_out:]
        res_batched = sp.batched[n_out:]
        per = _apart([[r[s] if b else r for r, b in zip(res, res_batched)] for s in range(len(plans))])
        # Output k of the step is state leaf k while k < the state's leaf count (the state comes first).
        at = np.cumsum(sp.out_known) - 1
        whole = {k: int(at[k]) for k in small_at if sp.out_known[k] and sp.batched[at[k]]}
        for s, plan in enumerate(plans):
            i, sp_i = plan.stack, plan.split
            unknown = jax.extend.core.jaxpr_as_fun(sp_i.unknown)
            u_outs = iter(unknown(*per[s], *plan.wides, xs[i], *dxs[i]))
            flat = []
            for k, kn in enumerate(sp_i.out_known):
                if not kn:
                    flat.append(next(u_outs))
                else:
                    v = known_outs[at[k]]
                    flat.append(v[s] if sp.batched[at[k]] else v)
            new_state, step = jax.tree_util.tree_unflatten(sp_i.out_def, flat)
            new_leaves = jax.tree.leaves(new_state)
            new_wides = []
            for k in range(plan.state_def.num_leaves):
                if k not in small_at:
                    new_wides.append(new_leaves[k])
                elif k not in whole:      # computed from the gradients (a gated step): written per stack
                    pack_rows.append(PackRows(group=group, leaf=holders[small_at.index(k)].leaf, rows=plan.in_pack,
                                              values=new_leaves[k]))
            results[i] = (_stored_form(stored[i], new_wides), step)
        # New packed leaves computed by the known part: one array for all these stacks' rows.
        for k, o in whole.items():
            v = known_outs[o]
            pack_rows.append(PackRows(group=group, leaf=holders[small_at.index(k)].leaf, rows=all_rows,
                                      values=v.reshape((-1,) + v.shape[2:])))
    return results, pack_rows


def step_stacks(rule: Any, stored: list, rows: list, sizes: list, xs: list, dxs: list, packs: tuple):
    """Run `rule` on some stacks (as `apply_all`), in the stored form: per stack `i`, `stored[i]` is its stored
    tree, `rows[i]` its stepping rows, `sizes[i]` its number of members, `xs[i]` / `dxs[i]` the stepping rows'
    parameters and gradients. Returns `(per stack (new state of its stepping rows, stored form; step),
    new pack rows (`PackRows`))`.

    A rule that does not look across parameters is split (`run`); one that does runs as a whole, reading its
    packed rows, except that a chain's leading stateless stages that look across (`ClipGlobalNorm`) run first
    over all stacks and the rest of the chain is split (when those stages return plain steps)."""
    rule_now, dxs_now, head = rule, dxs, 0
    if packs and ENABLED and looks_across(rule) is not None:
        pre = _across_prefix(rule, stored)
        if pre is not None:
            steps = apply_all(pre[0], [(None,) * pre[2]] * len(stored), xs, dxs)[1]
            if all(isinstance(s, jax.Array) for s in steps):
                rule_now, head = pre[1], pre[2]
                dxs_now = [(s, *d[1:]) for s, d in zip(steps, dxs)]
    views = [t[head:] for t in stored] if head else stored
    out: list = [None] * len(stored)
    pack_rows: list = []
    # A rule that asks for its stacks together (`Rule._hoist` False: SOAP orders its stacks' eigh / qr) runs whole.
    if packs and ENABLED and looks_across(rule_now) is None and getattr(rule_now, "_hoist", True):
        out, pack_rows = run(rule_now, views, rows, sizes, xs, dxs_now, packs)
    rest = [k for k, o in enumerate(out) if o is None]
    if rest:
        olds = [take_rows(t, rows[k], sizes[k]) for k, t in zip(rest, _filled_apart([views[k] for k in rest], packs))]
        sts, steps = apply_all(rule_now, olds, [xs[k] for k in rest], [dxs_now[k] for k in rest])
        for k, st, d in zip(rest, sts, steps):
            st, written = split_rows(views[k], rows[k], st)
            out[k] = (st, d)
            pack_rows += written
    if head:
        out = [((None,) * head + tuple(st), d) for st, d in out]
    return out, pack_rows


def _apart(per_stack: list) -> list:
    """Each stack's own arrays (a list per stack), behind one barrier when there are several stacks. Read as rows
    of one shared array (a pack, hoisted residuals), they are an operand the stacks' kernels share, and XLA:GPU
    fused every stack's parameter update into one multi-output kernel that read the new moments back from
    memory instead of computing them in the kernel that writes the parameter (more bytes a step than one pass
    over the state: `bench/NOTES.md`)."""
    return jax.lax.optimization_barrier(per_stack) if len(per_stack) > 1 else per_stack


def _filled_apart(views: list, packs: tuple) -> list:
    """`fill` of each stack's stored tree, its rows of the packs its own (`_apart`). A stack whose packs are its
    own (whole) passes them through the barrier. A stack that reads rows of packs it shares passes the whole
    packs and its own stored arrays through a barrier of its own (its arrays make the barriers distinct: XLA merges
    equal ones) and slices its rows inside its own kernels: sliced before a barrier, every row set was a kernel
    of its own (104 one-number kernels a step on the GPT-2 tree under SkipNonFinite)."""
    filled = [fill(v, packs) for v in views]
    if len(views) < 2:
        return filled
    flat = [jax.tree_util.tree_flatten(t, is_leaf=is_packed) for t in filled]
    stored_flat = [jax.tree_util.tree_flatten(v, is_leaf=is_packed) for v in views]
    stored = [leaves for leaves, _ in stored_flat]
    at = [[j for j, a in enumerate(leaves) if is_packed(a)] for leaves in stored]
    if not any(at) or any(len(f[0]) != len(leaves) for f, leaves in zip(flat, stored)):
        return filled
    # `fill` returns a pack itself where the stack's rows are all of it
    shared = [any(f[0][j] is not packs[leaves[j].group][leaves[j].leaf] for j in js)
              for f, js, leaves in zip(flat, at, stored)]
    whole = [k for k, s in enumerate(shared) if not s]
    out = list(filled)
    for k, own in zip(whole, _apart([[flat[k][0][j] for j in at[k]] for k in whole])):
        leaves = list(flat[k][0])
        for j, a in zip(at[k], own):
            leaves[j] = a
        out[k] = flat[k][1].unflatten(leaves)
    for k in (k for k, s in enumerate(shared) if s):
        leaves, treedef = list(stored_flat[k][0]), stored_flat[k][1]
        groups = sorted({leaves[j].group for j in at[k]})
        arrays = [j for j, a in enumerate(leaves) if isinstance(a, jax.Array)]
        read, mine = jax.lax.optimization_barrier(([packs[g] for g in groups], [leaves[j] for j in arrays]))
        for j, a in zip(arrays, mine):
            leaves[j] = a
        own_packs = list(packs)
        for g, p in zip(groups, read):
            own_packs[g] = p
        out[k] = fill(treedef.unflatten(leaves), tuple(own_packs))
    return out


def _across_prefix(rule: Any, stored: list):
    """For a chain whose first stages look across parameters and keep no state (`ClipGlobalNorm`) and whose
    other stages do not: `(chain of the first, chain of the others, how many first)`; else None."""
    if type(rule) is not OptimiserChain:
        return None
    stages, n = rule.rules, 0
    while n < len(stages) and looks_across(stages[n]) and all(t[n] is None for t in stored):
        n += 1
    if n == 0 or n == len(stages) or any(looks_across(s) for s in stages[n:]):
        return None
    return OptimiserChain(*stages[:n]), OptimiserChain(*stages[n:]), n
