"""Packs: the small arrays of many stacks' states stored together.

A rule's state often holds, besides arrays shaped like the parameter, a few numbers per parameter: Adam's
bias-correction powers `bt` (2 per parameter), step counts, RAdam's `t`. Stored per stack, a model of 1000
large parameters (each alone in its stack, see `optim._engine.stack`) would pass 1000 such arrays in and out of every
compiled step (each costs host time per call: `bench/NOTES.md`) and run a few tiny kernels per parameter to advance
them.
So `State` stores them *packed*: the small leaves of stacks with the same rule, state structure, small-leaf
shapes and dtypes, placement and number of members form a pack group (at most `PACK_MAX_ROWS` parameters), which
holds one array per small leaf with a row per parameter. In a stack's stored tree each packed leaf is a `Packed`
placeholder: a pytree node without children, so the plan (which pack, which rows) is part of the state's treedef,
static and compared by value. `fill` puts the rows back (slices); `update` instead runs the rule's small
arithmetic once per pack group on whole packs (`optim._engine.hoist`).

Which leaves are small is the state's to say: a state class (a named tuple) marks its fields that hold a few
numbers per parameter, whatever the parameter's shape, with the annotation `optim.fields.Small` (`AdamState`'s
`bt: Small`); every leaf under such a field is small when one parameter's part of it has at most `SMALL` elements
(`declared_small`). This holds for any parameter: a 2-element parameter's `bt` is shaped like it, and still small
(the kernel reads `bt` from packs, optim._engine.fused_kinds, so an unpacked one would send every stack of the
rule to XLA's path). A leaf no class declares (a user's rule, a dict state) is small by the fallback: at most
`SMALL` elements per parameter and not shaped like the parameter, unless it is not a float (a step count of a
scalar parameter is small); an undeclared float leaf shaped like the parameter is per element. Packing only
changes how the arrays are stored: `state.stacks`, `state[path]`, `state_dict` and checkpoints see the same
per-stack trees as before.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._base.export import register_for_export
from .._rules.fields import small_fields

__all__ = ["Packed", "PackRows", "SMALL", "PACK_MAX_ROWS", "pack", "fill", "is_packed", "split_rows", "assemble",
           "declared_small"]

SMALL = 8               # elements per parameter: bt (2), counts (1); Adafactor's row statistics are not small
PACK_MAX_ROWS = 64      # rows per pack group; XLA's compile time grows with the slices taken from one array


@dataclasses.dataclass(frozen=True)
class Packed:
    """Placeholder for a stack's small state leaf: rows `[start, stop)` of array `leaf` of pack group `group`,
    whose per-parameter part has `ndim` axes."""

    group: int
    leaf: int
    start: int
    stop: int
    ndim: int


class PackRows(NamedTuple):
    """New values for some rows of one packed leaf: rows `rows` of array `leaf` of pack group `group`."""

    group: int
    leaf: int
    rows: tuple[int, ...]
    values: Any                # one row per entry of `rows`


# A node without children, flattened and rebuilt by JAX's C++ (a dataclass node: no Python call per flatten).
jax.tree_util.register_dataclass(Packed, data_fields=[], meta_fields=[f.name for f in dataclasses.fields(Packed)])
register_for_export(Packed)

# `is_leaf=is_packed` keeps placeholders as leaves when flattening a stored tree; a C-level check (no Python
# frame per node of every flatten).
is_packed = Packed.__instancecheck__


def _leaves(tree: Any) -> tuple[list, Any]:
    return jax.tree_util.tree_flatten(tree, is_leaf=is_packed)


def _declares(node: Any) -> bool:
    return isinstance(node, tuple) and bool(small_fields(type(node)))


def declared_small(tree: Any) -> list[bool]:
    """Per leaf of a state tree (flatten order, `Packed` placeholders as leaves): whether it lies under a field
    that its state class declares small (annotated `optim.fields.Small`, `small_fields`), at any depth (an
    `EMAState`'s inner `AdamState`'s `bt`). A declared field's whole subtree is small; the other fields are
    searched for declarations of their own."""
    nodes, _ = jax.tree_util.tree_flatten(tree, is_leaf=lambda a: is_packed(a) or _declares(a))
    out: list[bool] = []
    for node in nodes:
        if not _declares(node):
            out.append(False)          # a leaf (or a placeholder) that no state class declares
            continue
        small, mine = small_fields(type(node)), []
        for name, field in zip(node._fields, node):
            mine += [True] * len(_leaves(field)[0]) if name in small else declared_small(field)
        # (a named tuple registered as a pytree of other children: its declaration is not read)
        out += mine if len(mine) == len(_leaves(node)[0]) else [False] * len(_leaves(node)[0])
    return out


def pack(layout: Any, stacks: tuple, member_shapes: list) -> tuple[tuple, tuple]:
    """Stored stacks and packs from per-stack trees. `member_shapes[s]`: per leaf of stack `s` (flatten order),
    one parameter's shape of that leaf, or None when unknown (the stack is then stored as it is).

    Stacks whose leaves do not have the expected `(members, *shape)` form (a state with batch axes from
    `vmap`/`pmap`) are stored as they are; so is everything when no leaf is small."""
    groups: dict = {}         # key -> group index
    rows: list[int] = []      # rows so far per group
    parts: list[list[list]] = []   # per group, per small leaf: the stacks' arrays
    stored = []
    for s, (stack, shapes) in enumerate(zip(stacks, member_shapes)):
        leaves, treedef = _leaves(stack)
        members = layout.stacks[s]
        n = len(members)
        p = layout.params[members[0]]
        if shapes is None or any(is_packed(a) for a in leaves) or len(shapes) != len(leaves):
            stored.append(stack)
            continue
        small = []
        for i, (a, shape, declared) in enumerate(zip(leaves, shapes, declared_small(stack))):
            if (shape is not None and hasattr(a, "shape") and tuple(a.shape) == (n, *shape)
                    and math.prod(shape) <= SMALL
                    and (declared or tuple(shape) != tuple(p.shape) or not jnp.issubdtype(a.dtype, jnp.inexact))):
                small.append(i)
        if not small:
            stored.append(stack)
            continue
        # Stacks of one size share packs: `update` runs their small arithmetic as one (`optim._engine.hoist`), reading
        # contiguous rows (no gather, no scatter).
        key = (p.rule, treedef, tuple((i, tuple(leaves[i].shape[1:]), jnp.dtype(leaves[i].dtype)) for i in small),
               _small_place(p), n)
        k = groups.get(key)
        if k is None or rows[k] + n > PACK_MAX_ROWS:
            k = groups[key] = len(rows)
            rows.append(0)
            parts.append([[] for _ in small])
        start = rows[k]
        rows[k] += n
        new = list(leaves)
        place = _small_place(p)
        for t, i in enumerate(small):
            parts[k][t].append(_placed(leaves[i], place))
            new[i] = Packed(k, t, start, start + n, leaves[i].ndim - 1)
        stored.append(treedef.unflatten(new))
    packs = tuple(tuple(_concat(col) for col in group) for group in parts)
    return tuple(stored), packs


def _small_place(p: Any) -> Any:
    """Where a parameter's small state arrays live: replicated over its (or its requested state's) mesh, on its
    device, or (None) on the default device. Parameters whose small arrays live alike share packs."""
    from .stack import stack_shardings

    where = p.state_place if p.state_place is not None else p.place
    places = None if where is None else stack_shardings(where)
    return where if places is None else places[1]


def _placed(a: Any, place: Any) -> Any:
    """A small leaf where its pack lives: replicated over the mesh of a requested or sharded placement. `setup`
    places a stack's arrays by their shape (one shaped like the parameter is sharded like its state), so a
    declared small leaf of a parameter of its shape (a 2-element parameter's `bt`) comes sharded."""
    if not isinstance(place, jax.sharding.NamedSharding) or not isinstance(a, jax.Array):
        return a
    if isinstance(a, jax.core.Tracer):
        from .stack import constrain
        return constrain(a, place)
    return a if a.sharding.is_equivalent_to(place, a.ndim) else jax.device_put(a, place)


def _concat(arrays: list) -> Any:
    if len(arrays) == 1:
        return arrays[0]
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.concatenate(arrays)
    return jnp.concatenate([jnp.asarray(a) for a in arrays])


def fill(stack: Any, packs: tuple) -> Any:
    """A stored stack's tree with its packed leaves read back (slices on the stack axis, behind any batch axes
    that `vmap` / `pmap` added)."""
    leaves, treedef = _leaves(stack)
    if not any(is_packed(a) for a in leaves):
        return stack
    out = []
    for a in leaves:
        if is_packed(a):
            arr = packs[a.group][a.leaf]
            axis = np.ndim(arr) - a.ndim - 1
            if a.start > 0 or a.stop < np.shape(arr)[axis]:    # (a pack of one stack is that stack's array)
                arr = arr[(slice(None),) * axis + (slice(a.start, a.stop),)]
            a = arr
        out.append(a)
    return treedef.unflatten(out)


def split_rows(stored: Any, rows: tuple, new: Any) -> tuple[Any, list]:
    """New state rows `new` (per-stack form, the stepping `rows` of the stack whose stored tree is `stored`) in
    stored form (placeholders kept), and their packed leaves as new pack rows (`PackRows`)."""
    leaves, treedef = _leaves(stored)
    if not any(is_packed(a) for a in leaves):
        return new, []
    written, out = [], []
    for a, b in zip(leaves, jax.tree.leaves(new)):
        if is_packed(a):
            written.append(PackRows(group=a.group, leaf=a.leaf, rows=tuple(a.start + r for r in rows), values=b))
            out.append(a)
        else:
            out.append(b)
    return treedef.unflatten(out), written


def pinned(rows: list, stored: list, shardings: list) -> list:
    """New pack rows (`PackRows`, from `split_rows` or `optim._engine.hoist`) constrained to
    where their packs live, for the stacks (stored trees `stored`) with a requested state sharding
    (`shardings[i]`, `setup(..., state_sharding=fn)`; None for none): replicated over its mesh, as every small
    state array is. A rule reading sharded state can compute some small leaves sharded (Adafactor's row
    statistics of a matrix whose rows ZeRO-1 splits): XLA would propagate that sharding into the pack with Auto
    mesh axes (the next step's state then differs from setup's), and with Explicit ones the pack's pieces,
    sharded differently, could not be joined."""
    from .stack import constrain, stack_shardings

    rep: dict = {}
    for tree, s in zip(stored, shardings):
        places = None if s is None else stack_shardings(s)
        if places is not None:
            rep.update((a.group, places[1]) for a in jax.tree.leaves(tree, is_leaf=is_packed) if is_packed(a))
    return [r._replace(values=constrain(r.values, rep[r.group])) if r.group in rep else r for r in rows]


def assemble(packs: tuple, rows: list) -> dict:
    """The pack groups that get new rows, with them written: `{group: new arrays}`. `rows`: a list of
    `PackRows` (from `split_rows` or `optim._engine.hoist`, disjoint); rows not written keep
    their old values. A pack whose rows all come in order from one array is that array; contiguous runs are concatenated
    with the old rows between them, other rows scattered."""
    by_leaf: dict = {}
    for r in rows:
        by_leaf.setdefault((r.group, r.leaf), []).append((tuple(r.rows), r.values))
    out = {}
    for k, group in enumerate(packs):
        if not any((k, t) in by_leaf for t in range(len(group))):
            continue
        new_group = []
        for t, old in enumerate(group):
            parts = sorted(by_leaf.get((k, t), []), key=lambda ra: ra[0][0])
            n = np.shape(old)[0]
            if not parts:
                new_group.append(old)
            elif all(r == tuple(range(r[0], r[-1] + 1)) for r, _ in parts):
                pieces, at = [], 0
                for r, a in parts:
                    if r[0] > at:
                        pieces.append(old[at:r[0]])
                    pieces.append(a.astype(old.dtype))
                    at = r[-1] + 1
                if at < n:
                    pieces.append(old[at:n])
                new_group.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces))
            else:
                new = jnp.asarray(old)
                for r, a in parts:
                    new = new.at[np.asarray(r)].set(a.astype(old.dtype))
                new_group.append(new)
        out[k] = tuple(new_group)
    return out

