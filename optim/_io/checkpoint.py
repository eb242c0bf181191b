"""Checkpoints that keep ties: `save(path, state, model=None)` and `load(path, like=...)`.

What the file holds: every leaf path of the model, the tie groups (canonical path and members, transformed
members with the function's name), the frozen flags, each rule's hyperparameters (schedules included: they
are pytrees of numbers), the step counter, every optimiser state array, and, when `model` is given, the model's
arrays (each tie group once) and plain Python leaves (numbers, strings). Classes (the model's node types, the
rules) come from `like`, which the caller builds with their own code, and the file must describe exactly the
same structure. A SHA-256 of every array and of the description detects corruption; `load` checks everything
against `like` before it builds anything (`Plan`), so a bad or mismatched file raises a `ValueError` that names
what differs and nothing is half-loaded.

Here: `save`, `load` and the load plan (`Plan`: matching a file's description to `like=`, then building the
`State` and model). The file format itself (one zip of a JSON description and an array blob, written
atomically; reading and validating it; tree signatures) is `_checkpoint_format`'s.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from .checkpoint_format import (FORMAT, VERSION, Malformed, Writer, check_description, open_checkpoint, read_arrays,
                                 signature, write_atomic)
from .._core.state import State, func_name
from .._base.tree import PyTree, flatten, show, structure_diff
from .load_plan import NO_MODEL, Mismatch, Plan, rule_repr

__all__ = ["save", "load"]


# ----------------------------------------------------------------------------------------------- save
def save(path: str | os.PathLike, state: State, model: PyTree | None = None) -> None:
    """Write `state` (and `model`, if given) to `path`, atomically.

    The file records the tie map, frozen flags, hyperparameters (schedules included), the step counter and
    every optimiser state array; with `model`, also the model's arrays (each tie group stored once) and its
    plain Python leaves (numbers, strings). Other leaves (functions, ...) are not stored: `load` takes them
    from its `like=` model. Arrays must be addressable from this process (on several hosts, gather first or
    save one file per process).

    The write goes to a temporary file in the same directory, which is fsynced and renamed over `path`; a
    crash mid-write leaves the previous checkpoint intact.

    Args:
        path: the file to write (replaced if it exists).
        state: the optimiser state, from `setup` or `update`.
        model: the model, to store with the state (optional).

    Raises:
        TypeError: `state` is not a `State`.
        ValueError: several leaves of the model share a dotted path (the file names leaves by path).

    >>> import jax.numpy as jnp, optim, tempfile, os
    >>> w = jnp.ones(3)
    >>> model = {"emb": w, "head": w}
    >>> state = optim.setup(optim.Adam(0.1), model)
    >>> grads = {"emb": jnp.ones(3), "head": jnp.ones(3)}
    >>> state, model = optim.update(state, model, grads)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
    >>> optim.save(path, state, model)
    >>> # untied: the file's tie map wins
    >>> fresh = {"emb": jnp.zeros(3), "head": jnp.zeros(3)}
    >>> like = (optim.setup(optim.Adam(0.1), fresh), fresh)
    >>> state2, model2 = optim.load(path, like=like)
    >>> int(state2.step), model2["emb"] is model2["head"], state2.ties()
    (1, True, {'emb': ('head',)})
    """
    if not isinstance(state, State):
        raise TypeError(f"save: expected the State from optim.setup, got {type(state).__name__}")
    lay = state.layout
    if lay.ambiguous:   # the file names leaves by dotted path
        raise ValueError(f"save: several leaves of this model share the dotted path "
                         f"{sorted(lay.ambiguous)[0]!r}, and checkpoints name leaves by dotted path; rename a key")
    paths = list(lay.paths)
    writer = Writer()
    meta: dict[str, Any] = {"format": FORMAT, "version": 1, "paths": paths,       # version: set below
                            "structure": signature(lay.treedef)}

    rules = []
    for k, rule in enumerate(state.rules):
        leaves, treedef = jax.tree_util.tree_flatten(rule)
        rules.append({"repr": rule_repr(rule), "structure": signature(treedef),
                      "leaves": [writer.leaf(v, f"hyperparameter {j} of rule {k}") for j, v in enumerate(leaves)]})
    meta["rules"] = rules

    params = []
    per_param = _param_states(state)
    for u, p in enumerate(lay.params):
        where = show(paths[p.canonical])
        leaves, treedef = jax.tree_util.tree_flatten(per_param[u])
        params.append({
            "canonical": paths[p.canonical], "members": [paths[i] for i in p.members],
            "transforms": [[paths[t.position], func_name(t.f), list(t.shape), jnp.dtype(t.dtype).name]
                           for t in p.transforms],
            "shape": list(p.shape), "dtype": jnp.dtype(p.dtype).name, "rule": p.rule, "frozen": lay.frozen[u],
            "state_structure": signature(treedef),
            "state": [writer.leaf(v, f"optimiser state {j} of {where}") for j, v in enumerate(leaves)]})
    meta["params"] = params
    meta["step"] = writer.leaf(state.step, "the step counter")

    if model is not None:
        leaves, treedef = jax.tree_util.tree_flatten(model)
        if treedef != lay.treedef:
            raise ValueError("save: the model does not have the structure this state was set up for: "
                             + structure_diff(paths, flatten(model)[0]))
        entries: list = [None] * len(leaves)
        for p in lay.params:        # each tie group once: its members point at the canonical array
            entry = writer.leaf(leaves[p.canonical], f"model leaf {show(paths[p.canonical])}")
            for i in p.members:
                entries[i] = entry
        for i, x in enumerate(leaves):
            if entries[i] is None:
                entries[i] = writer.leaf(x, f"model leaf {show(paths[i])}", optional=True)
        meta["model"] = entries
    else:
        meta["model"] = None

    meta["version"] = VERSION   # not older: optim before version 3 would read `bt` one step ahead
    meta["data_bytes"] = size = writer.fetch()
    body = json.dumps(meta, separators=(",", ":")).encode()
    write_atomic(os.fspath(path), body, writer.arrays, writer.entries, size)


def _param_states(state: State) -> list:
    """One optimiser state per parameter. The file stores them per parameter (not per stack), so it
    does not depend on how a version of optim groups parameters. Stacks are fetched to the host once and sliced
    there, when this process can see all of them."""
    stored = (state.stored, state.packs)
    if all(not isinstance(a, jax.Array) or (a.is_fully_addressable and not isinstance(a, jax.core.Tracer))
           for a in jax.tree.leaves(stored)):
        stored = jax.device_get(stored)
    return State(state.layout, state.rules, stored[0], state.step, stored[1]).param_states()


# ----------------------------------------------------------------------------------------------- load
def load(path: str | os.PathLike, like: Any) -> Any:
    """Read a checkpoint written by `save`, onto the structure given by `like`.

    `like` is what your code builds before training starts:

    - `like=state` (a `State` from `optim.setup(rule, fresh_model)`): returns the saved `State`;
    - `like=(state, model)`: returns `(state, model)`, the saved model's arrays in `model`'s structure, with
      every tie group's positions holding one array object (ties are re-linked even if `model` has none).

    From `like` come only what a file cannot hold without running code: the classes of the model's nodes and
    of the rules, and functions (of transformed ties, and of model leaves that are not arrays, numbers or
    strings). Everything else comes from the file: the tie map, frozen flags, hyperparameters (schedules
    included), the step counter, the optimiser state and the model's arrays. Each array is placed like its
    counterpart in `like` (its sharding, for sharded training).

    Args:
        path: a file written by `save`.
        like: a `State` from `optim.setup` on a freshly built model, or `(state, model)`.

    Returns:
        The saved `State`, or `(state, model)` when `like` is a pair.

    Raises:
        ValueError: naming what differs, when the file is truncated or corrupted, or was saved from another
            model (other leaf paths, node types, shapes, dtypes) or another rule; nothing is half-loaded.
        TypeError: `like` is neither a `State` nor a `(state, model)` pair.
    """
    like_state, like_model = _split_like(like)
    path = os.fspath(path)
    meta, read = open_checkpoint(path)
    try:
        return _restore(path, meta, read, like_state, like_model)
    finally:
        read.close()


def _split_like(like: Any) -> tuple[State, Any]:
    if isinstance(like, State):
        return like, NO_MODEL
    if isinstance(like, (tuple, list)) and len(like) == 2 and isinstance(like[0], State):
        state, model = like
        if jax.tree.structure(model) != state.layout.treedef:
            raise ValueError("load: like=(state, model): the model does not have the structure the state was "
                             "set up for: " + structure_diff(list(state.layout.paths), flatten(model)[0]))
        return state, model
    raise TypeError("load: like= takes the State from optim.setup on a freshly built model, or (state, model); "
                    f"got {type(like).__name__}")



def _restore(path: str, meta: dict, npz: Any, like: State, like_model: Any) -> Any:
    try:
        plan = _match(meta, like, like_model)
    except Mismatch as e:
        raise ValueError(f"load: {path} does not match like=: {e}") from None
    except Malformed as e:
        raise ValueError(f"load: {path} has a malformed description ({e})") from None
    arrays = read_arrays(path, meta, npz, plan.expect)
    return plan.build(arrays)


def _match(meta: dict, like: State, like_model: Any) -> Plan:
    """Check the file's description against like= and plan what `load` builds. Raises `Malformed` or
    `Mismatch`; once it returns, building cannot fail on anything in the file."""
    check_description(meta)
    plan = Plan(meta, like, like_model)
    plan.match_structure()
    plan.match_params()
    plan.match_rules()
    plan.want(meta["step"], "the step counter", (), jnp.int32)
    plan.match_model()
    return plan
