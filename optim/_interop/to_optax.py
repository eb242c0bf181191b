"""`to_optax`: an optim rule as an `optax.GradientTransformation`, for an existing optax loop (the other way,
`from_optax`, is `optim/_interop/optax.py`).

`init(params) = optim.setup(rule, params)` and `update(grads, state, params)` = one `optim.update`, returning
`new_params - params` as the updates, so `optax.apply_updates` gives optim's result. Ties are found by identity in
an eager `init` (outside `jit`, as optax loops do) and kept in the state's static tie map, so the update is
tie-correct inside the user's `jax.jit` too. A traced `init` (`jax.jit(tx.init)`, `jax.eval_shape(tx.init, params)`)
cannot see identity: it uses the `ties=` given to `to_optax`, else the ties an eager `init` of this transformation
found on a model of the same structure, shapes and dtypes, else treats the leaves as untied (`setup` warns once).
Flax NNX Variables given to `init` (what `nnx.Optimizer` passes) count as their values; one Variable object at
several positions is one tied parameter.

The rest is optax's protocol around a state that is optim's `State`: optax's complex-gradient convention, the
rule a transformation rebuilt by `optax.inject_hyperparams` carries, and the placeholder `init` of
`optax.tree.map_params`.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base.cache import LRU
from .optax import _from_optax_rules, with_extra_args
from .optax_checks import optax_module
from .._core.setup import _canonical_hyper, by_path, setup
from .._core.state import State
from .._rules.protocol import is_rule
from .._base.tree import PyTree, canonical_dtype, is_trainable, show
from .._core.update import update

__all__ = ["to_optax"]


def _delta(new: Any, old: Any) -> Any:
    if is_trainable(old):
        return new - old
    if isinstance(old, (jax.Array, np.ndarray)) and jnp.issubdtype(old.dtype, jnp.number):
        return jnp.zeros_like(old)
    if isinstance(old, (int, float, complex, np.number)) and not isinstance(old, bool):
        return type(old)(0)
    return None


def _jax_gradient(g: Any) -> Any:
    """A gradient in optax's convention as JAX's own: optax loops pass the conjugate of JAX's gradient of a complex
    parameter (so that their updates descend), while `optim.update` takes JAX's and conjugates it itself."""
    return jnp.conj(g) if isinstance(g, (jax.Array, np.ndarray)) and jnp.iscomplexobj(g) else g


# ------------------------------------------------------------------------------------------ NNX Variables
def _nnx_variable_type() -> type | None:
    """`flax.nnx.Variable` if flax's NNX is already imported (no Variable can exist otherwise), else None."""
    mod = sys.modules.get("flax.nnx")
    return getattr(mod, "Variable", None) if mod is not None else None


def _unwrap_variables(params: PyTree) -> PyTree:
    """`params` with every Flax NNX `Variable` (`nnx.Param`, ...) replaced by its value, as `nnx.as_pure` does.

    `nnx.Optimizer` calls `tx.init(nnx.state(model, wrt))`: a `nnx.State` of Variables, whose pytree node is the
    Variable (key `value`), while `tx.update` gets `nnx.as_pure` trees of plain arrays. Unwrapped, both have the
    same structure and paths. One Variable object at several positions (a shared parameter, in a tree built by
    hand; `nnx.state` in graph mode already lists a shared Variable once) is read once, so its positions hold one
    array object and `setup` ties them."""
    variable = _nnx_variable_type()
    if variable is None:
        return params
    from flax.nnx import variablelib

    is_ref = getattr(variablelib, "is_array_ref", lambda x: False)
    wrapped = lambda x: isinstance(x, variable) or is_ref(x)
    if not any(wrapped(x) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, variable))):
        return params                         # nothing of nnx's: the tree itself, untouched
    seen: dict[int, tuple[Any, Any]] = {}     # id(Variable or ref) -> (the object, kept alive; its value)

    def value(x: Any) -> Any:
        if not wrapped(x):
            return x
        if id(x) not in seen:
            if isinstance(x, variable):            # its raw value, as nnx.as_pure reads it (no get-hooks)
                raw = x.get_raw_value() if hasattr(x, "get_raw_value") else x.raw_value
                v = _unwrap_variables(raw)
            else:                                  # a mutable array reference: its current value
                v = x[...]
            seen[id(x)] = (x, v)
        return seen[id(x)][1]

    return jax.tree.map(value, params, is_leaf=lambda x: isinstance(x, variable))


# ------------------------------------------------------------------------------------------ map_params
def _is_params_placeholder(x: Any) -> bool:
    """Whether `x` is the object `optax.tree.map_params` passes to `init` in place of the parameters."""
    return type(x).__name__ == "_ParamsPlaceholder" and (type(x).__module__ or "").startswith("optax")


def _template(state: State) -> tuple[Any, tuple[bool, ...]]:
    """`state`'s tree structure and, per leaf, whether it is parameter-shaped: a stack's array of shape
    `(members, *parameter shape)` (Adam's m and v), as opposed to hyperparameters, counters, the step and the
    packed small leaves."""
    lay = state.layout

    def stacked(a: Any, shape: tuple) -> bool:
        s = tuple(getattr(a, "shape", ()))
        return len(s) == len(shape) + 1 and s[1:] == shape

    def mark(stack: Any, shape: tuple) -> Any:
        return jax.tree.map(lambda a: stacked(a, shape), stack)

    marked = State(lay, jax.tree.map(lambda _: False, state.rules),
                   tuple(mark(st, lay.params[lay.stacks[s][0]].shape) for s, st in enumerate(state.stored)),
                   False, jax.tree.map(lambda _: False, state.packs))
    leaves, treedef = jax.tree.flatten(marked)
    return treedef, tuple(leaves)


def _placeholder_state(built: LRU, placeholder: Any) -> State:
    """What `init` returns for optax's placeholder: the structure of the state this transformation built last,
    with the placeholder at its parameter-shaped leaves (see `to_optax`)."""
    if not len(built):
        raise TypeError("to_optax: optax.tree.map_params needs the optimiser state's structure, which depends on "
                        "the parameters (their ties and stacking): call tx.init(params) with this transformation "
                        "first (outside jit, where ties are visible)")
    _, treedef, flags = built.values()[-1]
    return treedef.unflatten([placeholder if f else 0 for f in flags])


# ------------------------------------------------------------------------------------------ traced init
def _signature(treedef: Any, leaves: list) -> tuple:
    """What a traced `init` must share with an eager one to reuse its ties: the tree structure and each trainable
    leaf's shape and dtype (a tracer has no identity, but these it has)."""
    return treedef, tuple((tuple(np.shape(x)), canonical_dtype(x.dtype)) if is_trainable(x) else None
                          for x in leaves)


def _tie_map(state: State) -> dict | None:
    """`state`'s ties as `setup`'s `ties=` (`{path: canonical_path}`, `{path: (canonical_path, f)}` for a
    transformed copy; `{}`: none), or None where a tie's dotted path names several leaves (it cannot be said
    by path)."""
    lay = state.layout
    paths, out = lay.paths, {}
    for p in lay.params:
        for i in p.members[1:]:
            out[paths[i]] = paths[p.canonical]
        for t in p.transforms:
            out[paths[t.position]] = (paths[p.canonical], t.f)
    if out and any(k in lay.ambiguous or (v if isinstance(v, str) else v[0]) in lay.ambiguous
                   for k, v in out.items()):
        return None
    return out


# ------------------------------------------------------------------------------------------ rebuilt rules
def _own_rules(rule: Any, state: State, params: PyTree) -> tuple:
    """The rules `rule` gives `state`'s parameters, one per entry of `state.rules` (which `adjust` may have
    split): each entry's first parameter's rule, with `rule`'s hyperparameters, as `setup` stores it."""
    lay = state.layout
    first = {}
    for p in lay.params:
        first.setdefault(p.rule, p.canonical)
    leaves = lay.treedef.flatten_up_to(params) if not is_rule(rule) and not isinstance(rule, by_path) else None
    # a table assigns all the leaves at once, as setup does (it checks that every pattern selects one)
    table = rule.assign(lay.paths, [i for p in lay.params for i in p.members]) if isinstance(rule, by_path) else None
    out = []
    for k, have in enumerate(state.rules):
        c = first.get(k)
        if c is None:            # an entry no parameter uses
            out.append(have)
            continue
        path = lay.paths[c]
        if is_rule(rule):
            mine = rule
        elif isinstance(rule, by_path):
            mine = table[c]
        else:                    # a function (path, array) -> rule, as setup calls it
            mine = rule(path, leaves[c])
        mine = _canonical_hyper(mine)
        if jax.tree.structure(mine) != jax.tree.structure(have):
            raise ValueError(f"to_optax: this transformation's rule for {show(path)} is {mine!r}, but its state was "
                             f"set up with {have!r}; a transformation rebuilt with new hyperparameters (as "
                             f"optax.inject_hyperparams does) must give the rules of the same types and structure")
        out.append(mine)
    return tuple(out)


def _checked_trees(state: State, extra: dict) -> list:
    """The per-parameter trees (`tree_args` of the `from_optax` rules inside) taken out of `extra`."""
    names: tuple = ()
    for r in _from_optax_rules(state.rules):
        if r.tree_args and names and r.tree_args != names:
            raise ValueError(f"to_optax: from_optax rules in one state take different tree_args "
                             f"({names!r} and {r.tree_args!r})")
        names = r.tree_args or names
    trees = []
    for n in names:
        if n not in extra:
            raise TypeError(f"to_optax: update needs the per-parameter tree {n}= (a from_optax tree_args entry)")
        trees.append(extra.pop(n))
    return trees


def to_optax(rule: Any, *, ties: dict | None = None) -> Any:
    """An `optax.GradientTransformationExtraArgs` that runs the optim `rule`, for an existing optax loop:

        # or optim.to_optax(optim.from_optax(optax.adam(1e-3)))
        tx = optim.to_optax(optim.Adam(1e-3))
        # eagerly: finds ties by object identity
        opt_state = tx.init(params)
        # inside your jax.jit as usual
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)

    `rule` is anything `optim.setup` takes: a rule, a function `(path, array) -> rule`, or an `optim.by_path`
    table. `init(params)` is `optim.setup(rule, params, ties=ties)`; `update(grads, state, params)` is one
    `optim.update` and returns `new_params - params` as the updates (`params` is required), so the tied
    positions get one update from the summed gradient and stay equal; `optax.apply_updates` reproduces optim's
    new values up to the rounding of that difference. The optax state is optim's `State` (inspect it with
    `state[path]`, change it with `optim.adjust` / `freeze`). Non-trainable leaves get a zero update (`None` for
    non-numbers). Keyword extra arguments go to the `from_optax` rules inside `rule` for that call (names in
    their `tree_args` as per-parameter trees); other transformations ignore them, as in optax.
    Use it as the whole optimiser or the last stage of an `optax.chain`: its output is a parameter change.

    A traced `init` (`jax.jit(tx.init)(params)`, `jax.eval_shape(tx.init, params)`, as orbax restores build their
    target) works, but a trace cannot see identity: it uses `ties=` when given, else the ties this
    transformation's last eager `init` found on a model of the same structure, shapes and dtypes, else it treats
    same-shaped leaves as separate parameters and `setup` warns once per model structure. With `ties=` (`{}`: no
    ties) there is no warning.

    Complex parameters: `grads` follow optax's convention, the conjugate of JAX's gradient (what optax's own
    loops pass, so that the updates descend); `update` conjugates them back before `optim.update`, which
    conjugates JAX's gradient itself, so `to_optax(optim.Adam(lr))` matches `optax.adam(lr)`.

    Hyperparameters: the transformation whose `init` built a state (for this model structure) steps with the
    state's rules, so `optim.adjust` and `freeze` on the optax state take effect. A transformation that did not
    build it steps with its own rule's hyperparameters: that is what `optax.inject_hyperparams(lambda lr:
    optim.to_optax(optim.Adam(lr)))` does, rebuilding the transformation from `opt_state.hyperparams` at each
    update, so changing `opt_state.hyperparams["lr"]` changes the step (its rule must have the types and
    structure of the state's rules, else `ValueError`). Under `inject_hyperparams`, change the injected
    hyperparameters there; `optim.adjust` on its `inner_state` is overridden by them. So keep one transformation
    for `init` and `update` when the state's rules are to drive; a state restored from a checkpoint counts as
    built by the transformation whose `init` made the restore target (`like=tx.init(params)`).

    `optax.tree.map_params(tx, f, opt_state)` (how Flax / MaxText code derives the state's shardings) works: `init`
    given optax's placeholder returns the structure of the state this transformation built or stepped last, and
    `f` is applied to its parameter-shaped leaves. optim stores the states of same-shaped parameters stacked, so
    these are arrays of shape `(members, *parameter shape)` (Adam's m and v); hyperparameters, counters and the
    step count as the rest (`transform_non_params`). Extra trees shaped like the parameters (`map_params`'s
    `*rest`) have no per-parameter leaves to meet in a stacked state: give `f` one argument.

    Flax NNX: `nnx.Optimizer(model, optim.to_optax(rule), wrt=nnx.Param)` and `optimizer.update(model, grads)`
    work as with any optax transformation. `init` takes Variables (`nnx.Param`, a `nnx.State` of them) as their
    values, with the paths `tx.update` later sees in `nnx.as_pure` trees (`l1.kernel`, no `.value`). A Variable
    shared by two modules is one parameter: `nnx.state` lists it once (and `nnx.grad` sums its uses); one Variable
    object at several positions of a tree given to `init` is a tie, like a repeated array.
    """
    optax = optax_module()
    if not is_rule(rule) and not callable(rule) and not isinstance(rule, by_path):
        raise TypeError(f"to_optax: {rule!r} is not an optim rule: give what optim.setup takes, a rule (init and "
                        f"apply), a function (path, array) -> rule, or an optim.by_path table")
    # The states this transformation's init built, by model structure: (layout, map_params template), and so
    # which states step with their own rules (8: a loop has one model; more only evicts old templates). `last`:
    # the layout seen last, so that a step of the usual loop costs one identity check, not hashing a treedef.
    built = LRU(8)
    last: list = [None]
    # The tie maps eager inits found (`_tie_map`), by `_signature`, for a traced init that cannot see identity
    # (8, as `built`).
    found = LRU(8)

    def init_fn(params: PyTree) -> State:
        if _is_params_placeholder(params):
            return _placeholder_state(built, params)
        model = _unwrap_variables(params)
        given = ties
        if ties is None:
            leaves, treedef = jax.tree_util.tree_flatten(model)
            key = _signature(treedef, leaves)
            traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
            if traced:
                given = found.get(key)       # None: setup treats possible ties as separate, and warns
        state = setup(rule, model, ties=given)
        if ties is None and not traced:
            found[key] = _tie_map(state)
        built[state.layout.treedef] = (state.layout, *_template(state))
        last[0] = state.layout
        return state

    def built_here(state: State) -> bool:
        """Whether this transformation's init built a state of `state`'s model structure."""
        lay = state.layout
        if lay is last[0]:
            return True
        entry = built.get(lay.treedef)
        if entry is None:
            return False
        if entry[0] != lay:          # freeze or adjust changed its layout: map_params needs the new one
            built[lay.treedef] = (lay, *_template(state))
        last[0] = lay
        return True

    def update_fn(updates: PyTree, state: State, params: PyTree | None = None, **extra: Any):
        if params is None:
            raise ValueError("to_optax: update needs params (optim rules step from the parameter values): "
                             "tx.update(grads, opt_state, params)")
        if not isinstance(state, State):
            raise TypeError(f"to_optax: expected the state from this transformation's init, got "
                            f"{type(state).__name__}")
        trees = _checked_trees(state, extra)
        run = state if built_here(state) else state.replace(rules=_own_rules(rule, state, params))
        if extra and _from_optax_rules(state.rules):
            run = with_extra_args(run, **extra)
        grads = jax.tree.map(_jax_gradient, updates)
        new_state, new_params = update(run, params, grads, *trees)
        # The state keeps its own rules: extra arguments are for this call only, and a rebuilt transformation's
        # hyperparameters live where it was rebuilt from; so its structure (and a scan's carry) is unchanged.
        new_state = new_state.replace(rules=state.rules)
        return jax.tree.map(_delta, new_params, params, is_leaf=lambda v: v is None), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
