"""Path-keyed optimiser state: `state_dict(state)` and `load_state_dict(like_state, tree)`.

A `State` stores its per-parameter states *stacked* (`optim/_core/state.py`): how parameters are grouped depends on
their rules, shapes, placement and on optim's grouping thresholds (`optim._engine.stack`). A state dict is the same
optimiser state as a plain pytree that depends on none of that:

    {"step": int32[], "params": {canonical_path: that parameter's state, exactly as its rule's init makes it}}

so any pytree checkpointer can write it, and restore it onto other shardings (orbax `StandardCheckpointer`,
`CheckpointManager`: see the README's checkpoint section). The rules (hyperparameters, schedules), the tie map
and the frozen flags are not in it: they come from `like_state`, the `setup` of your own code.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .._base.cache import memoize
from .._engine.stack import stack_states
from .._core.state import State, member_ndims, unwrap
from .._base.tree import describe, show, structure_diff, suggest

__all__ = ["state_dict", "load_state_dict"]


def state_dict(state: State) -> dict:
    """The optimiser state as a plain pytree keyed by canonical dotted path:
    `{"step": state.step, "params": {canonical_path: per-parameter state}}`.

    Each parameter (a tie group is one, under its canonical path, `state.paths()`) has its own entry, the
    state its rule's `init` returns, with its named fields: Adam's `AdamState(mu, nu, bt)`, Adafactor's dict,
    `None` for `Descent`, ... (a checkpointer writes them by name: `.../emb/mu`). A tree holding plain tuples or
    lists in their place (state dicts saved before states were named) loads too. The dict does not depend on how
    optim stacks parameters
    (grouping thresholds, placement), so a dict saved by one version or configuration loads into another.
    Not in it: the rules and their hyperparameters, the tie map, the frozen flags; `load_state_dict` takes
    them from its `like_state`.

    Pure pytree operations: works eagerly and inside `jit`. Each entry is a row sliced out of its stack (a row
    of a sharded stack keeps the parameter's sharding). Call it eagerly for a model with many parameters:
    inside `jit` the program gets one output per state array, and XLA's compile time grows with their number
    (eagerly each row is one small dispatch, or a numpy view of a host stack right after `setup`).

    Args:
        state: the optimiser state, from `setup` or `update`.

    Returns:
        `{"step": state.step, "params": {canonical_path: per-parameter state}}`.

    Raises:
        ValueError: the model's dotted names collide (`{"a.b": x, "a": {"b": y}}`): its parameters cannot be
            keyed by path.

    >>> import jax, jax.numpy as jnp, optim
    >>> w = jnp.ones(3)
    >>> # emb and head: one (tied) parameter
    >>> model = {"emb": w, "head": w, "bias": jnp.zeros(2)}
    >>> state = optim.setup(optim.Adam(0.1), model)
    >>> grads = {"emb": jnp.ones(3), "head": jnp.ones(3), "bias": jnp.ones(2)}
    >>> state, model = optim.update(state, model, grads)
    >>> tree = optim.state_dict(state)
    >>> sorted(tree["params"]), int(tree["step"])
    (['bias', 'emb'], 1)
    >>> # Adam's state, as its init makes it
    >>> jax.tree.map(jnp.shape, tree["params"]["emb"])
    AdamState(mu=(3,), nu=(3,), bt=(2,))
    """
    if not isinstance(state, State):
        raise TypeError(f"state_dict: expected the State from optim.setup, got {type(state).__name__}")
    paths = _keys(state, "state_dict")
    return {"step": state.step, "params": dict(zip(paths, state.param_states()))}


def load_state_dict(like_state: State, tree: Mapping) -> State:
    """The `State` whose optimiser state is `tree` (from `state_dict`, perhaps through a checkpointer), with
    `like_state`'s rules, tie map and frozen flags: the inverse of `state_dict`.

    `tree` must have exactly like_state's canonical paths, and each parameter's state like_state's structure,
    shapes and dtypes; so must `"step"`. Anything else is a `ValueError` that names the path and the leaf
    (missing and extra paths with "did you mean" suggestions), raised before anything is computed. The
    containers of a parameter's state come from like_state: a checkpointer that hands a tuple back as a list
    (same keys) is fine.

    Arrays are placed like the tree's, not like like_state's (restore onto new shardings with your
    checkpointer and they stay there): numpy arrays stay on the host, and the rows of a stack whose arrays
    share one sharding are stacked into that sharding with a leading unsharded axis (`P(None, *spec)` for a
    `NamedSharding`), where the rows already lie, so no array moves between devices. Rows placed unalike are
    stacked by `jnp.stack`, whose placement XLA chooses. Works inside `jit` too (stacks are then placed by
    XLA's sharding propagation). `tree` is not modified.

    Args:
        like_state: a `State` from `optim.setup` on the same model: the rules, tie map and frozen flags.
        tree: the optimiser state, as `state_dict` returns it.

    Returns:
        The `State`: `like_state` with `tree`'s step and per-parameter states.

    Raises:
        ValueError: `tree` does not match `like_state` (naming the path and the leaf).

    >>> import jax.numpy as jnp, optim
    >>> w = jnp.ones(3)
    >>> model = {"emb": w, "head": w}
    >>> state = optim.setup(optim.Adam(0.1), model)
    >>> grads = {"emb": jnp.ones(3), "head": jnp.ones(3)}
    >>> state, _ = optim.update(state, model, grads)
    >>> tree = optim.state_dict(state)
    >>> fresh = optim.setup(optim.Adam(0.1), model)
    >>> back = optim.load_state_dict(fresh, tree)
    >>> # head: emb's state
    >>> int(back.step), bool((back["head"].state.mu == state["emb"].state.mu).all())
    (1, True)
    >>> del tree["params"]["emb"]
    >>> optim.load_state_dict(fresh, tree)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: load_state_dict: the tree's parameters ...: missing 'emb'
    """
    if not isinstance(like_state, State):
        raise TypeError(f"load_state_dict: like_state must be the State from optim.setup on your model, got "
                        f"{type(like_state).__name__}")
    if not isinstance(tree, Mapping):
        raise TypeError(f"load_state_dict: expected the dict from optim.state_dict ({{'step': ..., 'params': "
                        f"{{path: state}}}}), got {type(tree).__name__}")
    odd = [k for k in tree if k not in ("step", "params")]
    if odd or "step" not in tree or "params" not in tree:
        what = (f"unexpected key {odd[0]!r}" + suggest(str(odd[0]), ["step", "params"]) if odd
                else f"no {'step' if 'step' not in tree else 'params'!r} key")
        raise ValueError(f"load_state_dict: the tree has {what}; a state dict is {{'step': ..., 'params': "
                         "{canonical_path: state}}")
    params = tree["params"]
    if not isinstance(params, Mapping):
        raise ValueError(f"load_state_dict: tree['params'] must be a dict {{canonical_path: state}}, got "
                         f"{type(params).__name__}")
    lay = like_state.layout
    paths = _keys(like_state, "load_state_dict")
    _check_paths(paths, params)
    step = _check_step(like_state.step, tree["step"])

    # Every parameter's leaves, checked against like_state's per-parameter state (per stack: its members share
    # one rule, shape and dtype), before anything is built.
    columns_of: list = []           # per stack: its treedef, the stack axis of each leaf, and per leaf its rows
    for s, stack in enumerate(lay.stacks):
        like_def, members = _member_abstract(like_state, s)
        columns: list = [[] for _ in members]
        for u in stack:
            path = paths[u]
            for j, a in enumerate(_state_leaves(params[path], like_def, path, like_state, u)):
                want_shape, want_dtype, _ = members[j]
                got_shape, got_dtype = _shape_dtype(a)
                if got_shape != want_shape or got_dtype != want_dtype:
                    raise ValueError(f"load_state_dict: {_leaf_name(like_def, j)} of {show(path)} is "
                                     f"{_describe(a)}, like_state's is "
                                     f"{jnp.dtype(want_dtype).name}{list(want_shape)}")
                columns[j].append(a)
        columns_of.append((like_def, [axis for _, _, axis in members], columns))

    stacks = tuple(like_def.unflatten([_stack(col, axis) for col, axis in zip(columns, axes)])
                   for like_def, axes, columns in columns_of)
    return State(lay, like_state.rules, stacks, step)


# ------------------------------------------------------------------------------------------------- checks
def _keys(state: State, who: str) -> list[str]:
    """The state's canonical paths, which must name one leaf each to key a dict."""
    lay = state.layout
    paths = state.paths()
    if lay.ambiguous:
        clash = next((p for p in paths if p in lay.ambiguous), None)
        if clash is not None:
            raise ValueError(f"{who}: several leaves of this model share the dotted path {show(clash)}, and a state "
                             "dict keys parameters by dotted path; rename a key (e.g. a key 'a.b' beside a subtree "
                             "'a' with key 'b')")
    return paths


def _check_paths(paths: list[str], params: Mapping) -> None:
    """The tree's keys are exactly like_state's canonical paths."""
    have = set(paths)
    if len(params) == len(paths) and all(k in have for k in params):
        return
    keys = list(params)
    extra = [k for k in keys if k not in have]
    msg = structure_diff(paths, keys, missing="missing", unexpected="extra")
    if extra:
        missing = [p for p in paths if p not in params]
        msg += suggest(str(extra[0]), missing or paths)
    raise ValueError(f"load_state_dict: the tree's parameters are not like_state's: {msg}")


def _check_step(like: Any, step: Any) -> Any:
    """`tree["step"]`: like_state's shape and dtype (a Python int is taken as that dtype)."""
    if isinstance(step, int) and not isinstance(step, bool) and np.ndim(like) == 0:
        return jnp.asarray(step, like.dtype)
    got, want = _shape_dtype(step), _shape_dtype(like)
    if got != want:
        raise ValueError(f"load_state_dict: 'step' is {_describe(step)}, like_state's is "
                         f"{jnp.dtype(want[1]).name}{list(want[0])}")
    return step


def _shape_dtype(a: Any) -> tuple:
    dtype = getattr(a, "dtype", None)
    if dtype is None or not hasattr(a, "shape"):
        return None, None
    return tuple(a.shape), jnp.dtype(dtype)


def _describe(a: Any) -> str:
    return describe(a) if _shape_dtype(a)[0] is not None else f"a {type(a).__name__} ({a!r})"


def _member_abstract(state: State, s: int) -> tuple[Any, list[tuple]]:
    """Stack `s`'s per-parameter state: its treedef and, per leaf, (shape, dtype, the stack's axis), where the
    stack axis comes after any leading axes a `vmap` / `pmap` of the whole state added (see
    `State.param_state`)."""
    u = state.layout.stacks[s][0]
    leaves, treedef = jax.tree_util.tree_flatten(state.stacks[s])
    out = []
    for a, nd in zip(leaves, member_ndims(state, u, treedef)):
        axis = np.ndim(a) - nd - 1
        shape = tuple(np.shape(a))
        out.append((shape[:axis] + shape[axis + 1:], jnp.dtype(a.dtype), axis))
    return treedef, out


def _state_leaves(s: Any, like_def: Any, path: str, like: State, u: int) -> list:
    """The leaves of one parameter's state in the tree, which must have like_def's structure: the same key
    paths, by name or by position (a list where like has a tuple is fine, and a plain tuple or list where like
    has a named tuple, as state dicts held before states were named: the containers come from like)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(s)
    if treedef == like_def:
        return [a for _, a in pairs]
    template = like_def.unflatten([0] * like_def.num_leaves)
    got = {_plain(kp): a for kp, a in pairs}        # by key: a dict flattens its keys sorted, a named tuple not
    for t in (template, _untuple(template)):
        want = [_plain(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
        if len(got) == len(pairs) and sorted(got, key=repr) == sorted(want, key=repr):
            return [got[k] for k in want]
    rule = unwrap(like.rules[like.layout.params[u].rule])
    raise ValueError(f"load_state_dict: the optimiser state of {show(path)} has another structure: the tree has "
                     f"{treedef}, like_state's (rule {rule!r}) has {like_def}")


def _plain(keypath: tuple) -> tuple:
    """A key path with sequence indices and flattened-index keys alike (a tuple, a list), and a named tuple's
    field like a dict's key of that name (a checkpointer may restore one as the other)."""
    return tuple(("#", k.idx) if isinstance(k, jax.tree_util.SequenceKey) else
                 ("#", k.key) if isinstance(k, jax.tree_util.FlattenedIndexKey) else
                 (".", k.name) if isinstance(k, jax.tree_util.GetAttrKey) else
                 (".", k.key) if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str) else k
                 for k in keypath)


def _untuple(t: Any) -> Any:
    """`t` with every named tuple a plain tuple (the positional form of a state)."""
    if isinstance(t, tuple):
        return tuple(_untuple(v) for v in t)
    if isinstance(t, list):
        return [_untuple(v) for v in t]
    if isinstance(t, dict):
        return {k: _untuple(v) for k, v in t.items()}
    return t


def _leaf_name(treedef: Any, j: int) -> str:
    """How errors name leaf `j` of a parameter's state: 'optimiser state [1]' (its key path in the state)."""
    kp = jax.tree_util.tree_flatten_with_path(treedef.unflatten(list(range(treedef.num_leaves))))[0][j][0]
    return f"optimiser state {jax.tree_util.keystr(kp)}" if kp else "the optimiser state"


# ------------------------------------------------------------------------------------------------- building
def _stack(col: list, axis: int) -> Any:
    """The rows of one state field stacked on `axis`, placed where the rows are (see `load_state_dict`)."""
    if axis == 0:
        if all(isinstance(a, np.ndarray) for a in col):
            return stack_states(col)          # host stays host (np.stack)
    elif all(isinstance(a, np.ndarray) for a in col):
        return np.stack(col, axis)
    target = _stacked_sharding(col, axis)
    if target is None:
        return jnp.stack([jnp.asarray(a) for a in col], axis)
    return _stacker(axis, target)(list(col))


def _stacked_sharding(col: list, axis: int) -> Any:
    """The sharding of rows that all share one sharding, stacked on a new unsharded `axis`; None when they do
    not (or are traced)."""
    first = col[0]
    if not isinstance(first, jax.Array) or isinstance(first, jax.core.Tracer):
        return None
    s = first.sharding
    for a in col[1:]:
        if not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer) or (a.sharding is not s
                                                                             and a.sharding != s):
            return None
    if isinstance(s, jax.sharding.NamedSharding):
        spec = list(s.spec)     # P(None, *spec) on axis 0, as `setup` places a sharded parameter's stack
        spec += [None] * (axis - len(spec))
        spec.insert(axis, None)
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=s.memory_kind)
    return None      # one device: jnp.stack keeps the rows' device (and whether they are committed to it)


# 256 (axis, sharding) pairs: a model's stacks use a few; each holds a jitted function and its compiled programs.
@memoize(256)
def _stacker(axis: int, sharding: Any) -> Any:
    return jax.jit(lambda xs: jnp.stack(xs, axis), out_shardings=sharding)
