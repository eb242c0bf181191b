"""The load plan of `optim.load`: a checkpoint file's description matched against `like=` step by step, before
any array is read (`Plan`), then the `State` (and model) built from the arrays.

Each `match_*` step checks one part of the description and raises `Mismatch` (another model or rule than
like='s) or `Malformed` (a description that is not well formed), so that once the plan is complete building
cannot fail on anything in the file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .checkpoint_format import (ARRAYS, Malformed, clean, dtype_name, dtype_named, key_type, python_value,
                                 same_rule_structure, same_state_structure, signature)
from .._core.layout import Layout, Param, PathError, TiedCopy
from .._core.state import State, func_name, unwrap
from .._rules.hyper import is_schedule
from .._rules.moments import powers_from_next
from .._base.tree import show, structure_diff

__all__ = ["Plan", "Mismatch", "NO_MODEL", "rule_repr", "destination"]

# like= without a model: `load` returns the state alone.
NO_MODEL = object()


class Mismatch(ValueError):
    """The file is a checkpoint of another model or rule than like='s."""


class Plan:
    """What `load` builds, matched against like= step by step (`_match`) before any array is read: each step
    checks a part of the description (raising `Mismatch` or `Malformed`) and records what `build` needs,
    among it `expect`, the arrays to read. `build` then assembles the result from them."""

    def __init__(self, meta: dict, like: State, like_model: Any):
        self.meta = meta
        self.like = like
        self.paths = list(like.layout.paths)
        # array name -> (what, shape, dtype, PRNG key implementation or None)
        self.expect: dict[str, tuple[str, tuple, Any, str | None]] = {}
        # match_params: the file's parameters (tie groups on like='s treedef) and frozen flags, the layout they
        # make, and per parameter the optimiser state to build: (like's state treedef, the file's entries, like's
        # leaves)
        self.params: list[Param] = []
        self.frozen: list[bool] = []
        self.layout: Layout = like.layout
        self.states: list[tuple] = []
        # the saved rule index -> like='s rule of a parameter using it: the class that rule is rebuilt with
        self.like_rule_of: dict[int, Any] = {}
        # per saved rule (match_rules): (like's rule treedef, the file's entries, like's leaves)
        self.rules: list[tuple] = []
        # the model (match_model): like='s leaves and the file's entries; None when like= has no model
        self.like_leaves: list | None = None if like_model is NO_MODEL else jax.tree.leaves(like_model)
        self.model_entries: list | None = None

    # ----------------------------------------------------------------------------------------- matching
    def match_structure(self) -> None:
        """The file's model has like='s leaf paths, node types and static data."""
        saved = self.meta["paths"]
        if saved != self.paths:
            raise Mismatch("the checkpoint was saved from another model: " + structure_diff(
                saved, self.paths, missing="like= lacks", unexpected="the checkpoint lacks"))
        where = _first_difference(self.meta["structure"], signature(self.like.layout.treedef))
        if where is not None:
            k, a, b = where
            raise Mismatch(f"the model's structure differs near "
                            f"{show(self.paths[k]) if k < len(self.paths) else '<end>'}: "
                            f"the checkpoint has a node {a}, like= has {b}")

    def match_params(self) -> None:
        """The file's tie groups on like='s treedef, with the rule classes and state structures of like=; every
        trainable leaf of like= in exactly one of them."""
        lay = self.like.layout
        owner: dict[int, str] = {}        # model position -> its parameter
        for sp in self.meta["params"]:
            self.params.append(self._param(sp, owner))
            self.frozen.append(sp["frozen"])
        for i in range(len(self.paths)):
            if lay.param_of[i] >= 0 and i not in owner:
                raise Mismatch(f"{show(self.paths[i])} is a trainable leaf of like= but not a parameter in the "
                                "checkpoint")
        layout = Layout(lay.treedef, tuple(self.params), tuple(self.frozen), lay.wide)
        self.layout = lay if layout == lay else layout     # identical: keep like's (computed paths, identity)

    def _param(self, sp: dict, owner: dict[int, str]) -> Param:
        """One saved parameter, checked against like='s parameter at its canonical path."""
        lay, where = self.like.layout, show(sp["canonical"])
        try:
            u = lay.param(sp["canonical"])
        except PathError:
            raise Mismatch(f"{where} is a parameter in the checkpoint but not a trainable leaf of like=") from None
        lp = lay.params[u]
        shape, dtype = tuple(sp["shape"]), dtype_named(sp["dtype"], where)
        if (shape, dtype) != (lp.shape, jnp.dtype(lp.dtype)):
            raise Mismatch(f"parameter {where}: the checkpoint has {dtype.name}{list(shape)}, like= has "
                            f"{jnp.dtype(lp.dtype).name}{list(lp.shape)}")
        members = [self._member(m, shape, dtype, where) for m in sp["members"]]
        transforms = [self._tied_copy(t, sp["canonical"]) for t in sp["transforms"]]
        for i in members + [t.position for t in transforms]:
            if i in owner:
                raise Mismatch(f"{show(self.paths[i])} belongs to two parameters ({owner[i]} and {where})")
            owner[i] = where
        self._rule(sp["rule"], self.like.rules[lp.rule], where)
        self._state(sp, u, where)
        # like='s parameter with the file's tie group and rule index: its placement and requested state sharding
        return dataclasses.replace(lp, canonical=lay.index[sp["canonical"]], members=tuple(members), rule=sp["rule"],
                                   transforms=tuple(transforms))

    def _member(self, path: str, shape: tuple, dtype: np.dtype, where: str) -> int:
        """A position the file ties to the parameter at `where`: a trainable leaf of like= of its shape and dtype."""
        lay = self.like.layout
        i = lay.index[path]
        q = lay.params[lay.param_of[i]] if lay.param_of[i] >= 0 else None
        if q is None or (q.shape, jnp.dtype(q.dtype)) != (shape, dtype) or any(t.position == i for t in q.transforms):
            raise Mismatch(f"{show(path)} is tied to {where} in the checkpoint but is not a trainable "
                            f"{dtype.name}{list(shape)} leaf of like=")
        return i

    def _tied_copy(self, saved: list, canonical: str) -> TiedCopy:
        """A position the file ties to `canonical` through a function, which like= must tie alike (functions are
        not stored)."""
        path, fname, shape, dtype = saved
        i = self.like.layout.index[path]
        f = next((t.f for q in self.like.layout.params for t in q.transforms if t.position == i), None)
        if f is None:
            raise Mismatch(f"the checkpoint ties {show(path)} to {fname}({show(canonical)}); functions are not "
                            f"stored, so set up like= with the same tie: ties={{{path!r}: ({canonical!r}, "
                            f"{fname})}}")
        if func_name(f) != fname:
            raise Mismatch(f"{show(path)} is {fname}({show(canonical)}) in the checkpoint but {func_name(f)}(...) "
                            "in like=")
        return TiedCopy(i, f, tuple(shape), dtype_named(dtype, path))

    def _rule(self, k: int, like_rule: Any, where: str) -> None:
        """like='s rule for a parameter must have the structure of the saved rule `k`: it is the class that rule
        is rebuilt with."""
        saved = self.meta["rules"][k]
        template = _template(saved, like_rule)
        if template is None:
            raise Mismatch(f"the rule of {where} differs: the checkpoint has {saved['repr']}, like= has "
                            f"{rule_repr(like_rule)}")
        self.like_rule_of.setdefault(k, template)

    def _state(self, sp: dict, u: int, where: str) -> None:
        """A parameter's optimiser state: like='s structure, the file's arrays (checked for shape and dtype)."""
        like_leaves, like_def = jax.tree_util.tree_flatten(self.like.param_state(u))
        if not same_state_structure(sp["state_structure"], like_def) or len(like_leaves) != len(sp["state"]):
            like_rule = self.like.rules[self.like.layout.params[u].rule]
            raise Mismatch(f"the optimiser state of {where} has another structure: the checkpoint's rule is "
                            f"{self.meta['rules'][sp['rule']]['repr']}, like='s is {rule_repr(like_rule)}")
        for j, (entry, x) in enumerate(zip(sp["state"], like_leaves)):
            self._want_like(entry, x, f"optimiser state {j} of {where}")
        self.states.append((like_def, sp["state"], like_leaves))

    def match_rules(self) -> None:
        """Every saved rule: like='s class (its parameters' rule, else like='s rule of the same index and
        structure) with the file's hyperparameters."""
        for k, saved in enumerate(self.meta["rules"]):
            template = self.like_rule_of.get(k)
            if template is None:
                template = _template(saved, self.like.rules[k]) if k < len(self.like.rules) else None
                if template is None:
                    raise Mismatch(f"the checkpoint's rule {saved['repr']} has no counterpart in like=")
            leaves, treedef = jax.tree_util.tree_flatten(template)
            if len(leaves) != len(saved["leaves"]):
                raise Malformed("rule leaves do not match the rule's structure")
            for j, (entry, x) in enumerate(zip(saved["leaves"], leaves)):
                what = f"hyperparameter {j} of {saved['repr']}"
                if _int_hyperparameter(entry, x):   # written before hyperparameters were floats: widened in build
                    self.want(entry, what, np.shape(x), dtype_named(entry["dtype"], what))
                else:
                    self._want_like(entry, x, what)
            self.rules.append((treedef, saved["leaves"], leaves))

    def match_model(self) -> None:
        """The model's entries, when like= has a model: tied positions hold their parameter's shape and dtype,
        other arrays like='s (or, where like= has a Python value, the file's)."""
        if self.like_leaves is None:
            return
        entries = self.meta["model"]
        if entries is None:
            raise Mismatch("like= has a model but the checkpoint holds none (it was saved without model=)")
        if len(entries) != len(self.like_leaves):
            raise Malformed("model entries do not match the leaf paths")
        placed = {}
        for p in self.params:
            placed.update({i: (p.shape, p.dtype) for i in p.members})
            placed.update({t.position: (t.shape, t.dtype) for t in p.transforms})
        for i, (entry, x) in enumerate(zip(entries, self.like_leaves)):
            what = f"model leaf {show(self.paths[i])}"
            if i in placed:
                self.want(entry, what, *placed[i])
            elif "array" in entry and isinstance(x, ARRAYS):
                self.want(entry, what, np.shape(x), x.dtype)
            elif "array" in entry:
                self.want(entry, what)      # like= has a Python value there: the file's array, as saved
            else:
                python_value(entry, None)        # validate now: nothing may fail once building starts
        self.model_entries = entries

    def want(self, entry: dict, what: str, shape: tuple | None = None, dtype: Any = None) -> None:
        """Read `entry`'s array; if `shape` is given, it must have that shape and dtype (keys: of the keys)."""
        if "array" not in entry:
            raise Mismatch(f"{what}: the checkpoint has a Python {entry.get('py')}, like= has an array")
        got_shape, got_dtype = tuple(entry["shape"]), entry["dtype"]
        key = entry.get("key")
        if key is not None:      # typed PRNG keys: compare the keys' shape and dtype, not their data's
            if not isinstance(key, str):
                raise Malformed(f"{what}: key implementation {key!r} is not a name")
            keys = key_type(key, got_shape, dtype_named(got_dtype, what))
            if keys is None:
                raise Mismatch(f"{what}: the checkpoint holds PRNG keys of implementation {key!r} with data "
                                f"{got_dtype}{list(got_shape)}, which this JAX cannot rebuild")
            got_shape, got_dtype = keys
        if shape is not None and (tuple(shape) != got_shape or dtype_name(dtype) != got_dtype):
            raise Mismatch(f"{what}: the checkpoint has {got_dtype}{list(got_shape)}, like= has "
                            f"{dtype_name(dtype)}{list(shape)}")
        self.expect[entry["array"]] = (what, tuple(entry["shape"]), dtype_named(entry["dtype"], what), key)

    def _want_like(self, entry: dict, x: Any, what: str) -> None:
        """`entry` where like= has `x`: an array of x's shape and dtype, or a Python value."""
        if isinstance(x, ARRAYS):
            self.want(entry, what, np.shape(x), x.dtype)
        elif "array" in entry:
            raise Mismatch(f"{what}: the checkpoint has an array, like= has a Python {type(x).__name__}")
        else:
            python_value(entry, x)

    # ----------------------------------------------------------------------------------------- building
    def build(self, arrays: dict) -> Any:
        """The loaded `State` (and model) from `arrays` (what `expect` names, read and checked). Pass 1 decides
        every leaf (a Python value, or which array goes where); pass 2 moves all arrays to their devices in two
        batched transfers; pass 3 assembles. Tied members share one transfer."""
        slots: dict = {}

        def put(entry: dict, like_x: Any) -> Any:
            if "array" not in entry:
                return _Value(python_value(entry, like_x))
            key = (entry["array"], destination(like_x))
            return slots.setdefault(key, _Slot(key))

        rule_parts = [(td, [put(e, x) for e, x in zip(es, xs)]) for td, es, xs in self.rules]
        state_parts = [(td, [put(e, x) for e, x in zip(es, xs)]) for td, es, xs in self.states]
        model_parts: list = []
        if self.like_leaves is not None:
            entries, like_leaves = self.model_entries, self.like_leaves
            model_parts = [None] * len(like_leaves)
            for p in self.params:                 # one array object per tie group
                value = put(entries[p.canonical], like_leaves[p.canonical])
                for i in p.members:
                    model_parts[i] = value
            for i, (entry, x) in enumerate(zip(entries, like_leaves)):
                if model_parts[i] is None:
                    model_parts[i] = put(entry, x)

        _transfer(list(slots.values()), arrays)

        rules = tuple(jax.tree_util.tree_unflatten(td, [_widen(v.value, x) for v, x in zip(vs, xs)])
                      for (td, vs), (_, _, xs) in zip(rule_parts, self.rules))
        states = [jax.tree_util.tree_unflatten(td, [v.value for v in vs]) for td, vs in state_parts]
        if self.meta["version"] < 3:     # the Adam family's powers: of the next step then, of the steps taken now
            states = [powers_from_next(unwrap(rules[p.rule]), s) for p, s in zip(self.layout.params, states)]
        step = _place_like(jnp.asarray(arrays[self.meta["step"]["array"]], jnp.int32), self.like.step)
        state = State.of_params(self.layout, rules, states, step)
        if self.layout == self.like.layout:     # stacks go where like='s are (the same shardings, spelled alike)
            ours, like = (state.stored, state.packs), (self.like.stored, self.like.packs)
            if jax.tree.structure(ours) == jax.tree.structure(like):
                stored, packs = jax.tree.map(_place_like, ours, like)
                state = State(self.layout, rules, stored, step, packs)
            else:
                state = State(self.layout, rules, jax.tree.map(_place_like, state.stacks, self.like.stacks), step)
        if self.like_leaves is None:
            return state
        return state, self.like.layout.treedef.unflatten([v.value for v in model_parts])


def _transfer(slots: list, arrays: dict) -> None:
    """Fill every slot with its array, where it goes (`destination`): host arrays as they are, the others in two
    batched transfers (to the default device; to their shardings)."""
    plain = [sl for sl in slots if sl.key[1] is None]
    placed = [sl for sl in slots if sl.key[1] is not None and sl.key[1] is not _HOST]
    for sl in slots:
        if sl.key[1] is _HOST:
            sl.value = arrays[sl.key[0]]
    for group, values in ((plain, jax.device_put([arrays[sl.key[0]] for sl in plain])),
                          (placed, jax.device_put([arrays[sl.key[0]] for sl in placed],
                                                  [sl.key[1] for sl in placed]))):
        for sl, v in zip(group, values):
            sl.value = v


def _place_like(a: Any, like: Any) -> Any:
    if isinstance(like, jax.Array) and not isinstance(like, jax.core.Tracer) and (
            not isinstance(a, jax.Array) or a.sharding != like.sharding):
        return jax.device_put(a, like.sharding)
    return a


class _Value:
    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class _Slot:
    """One array to load, and where it goes: `(array name, destination(like's leaf))`; filled in by `build`."""

    __slots__ = ("key", "value")

    def __init__(self, key: tuple):
        self.key, self.value = key, None


def _int_hyperparameter(entry: Any, x: Any) -> bool:
    """An integer hyperparameter in the file where like= has a floating one: files written before optim stored
    hyperparameters given as ints (`Descent(1)`) as floats. They load, widened to like='s dtype."""
    if not (isinstance(entry, dict) and "array" in entry and "key" not in entry and isinstance(entry.get("dtype"), str)
            and isinstance(x, ARRAYS) and jnp.issubdtype(x.dtype, jnp.floating)):
        return False
    try:
        return bool(np.issubdtype(np.dtype(entry["dtype"]), np.integer))
    except TypeError:
        return False


def _widen(v: Any, like_x: Any) -> Any:
    """A hyperparameter in like='s dtype (only differs for `_int_hyperparameter`)."""
    if hasattr(v, "dtype") and hasattr(like_x, "dtype") and v.dtype != like_x.dtype:
        return jnp.asarray(v, like_x.dtype)
    return v


def rule_repr(rule: Any) -> str:
    """How a description names a rule."""
    return clean(repr(unwrap(rule)))


def _first_difference(saved: list, like: list):
    """`(leaf index, saved node, like node)` at the first differing node, or None."""
    leaf = 0
    for a, b in zip(saved, like):
        if a != b:
            return leaf, a, b
        leaf += a == "*"
    if len(saved) != len(like):
        return leaf, "(end)" if len(saved) < len(like) else saved[len(like)], \
            "(end)" if len(like) < len(saved) else like[len(saved)]
    return None


_HOST = "host"


def destination(x: Any) -> Any:
    """Where a loaded array goes, following its counterpart in `like`:

    - a numpy array (what `setup` gives for state on the default device): stays a read-only numpy array, which
      the first `update` moves to the device (a device transfer per array would dominate loading a model with
      tens of thousands of leaves);
    - a jax array committed to a sharding or device: that sharding;
    - an uncommitted jax array: the default device, uncommitted (a committed copy of an uncommitted
      hyperparameter would clash with sharded arguments in `jit`).
    """
    if isinstance(x, np.ndarray):
        return _HOST
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and getattr(x, "committed", True):
        return x.sharding
    return None


def _template(saved: dict, rule: Any) -> Any:
    """like='s `rule` as the template the saved rule is rebuilt with, or None where its structure is another:
    `rule` itself, or `rule` with the schedules the run replaced by numbers (`adjust(lr=1e-4)`) replaced so too."""
    if same_rule_structure(saved["structure"], rule):
        return rule
    return _with_saved_numbers(saved["structure"], saved["leaves"], rule)


def _with_saved_numbers(saved: list[str], entries: list, rule: Any) -> Any:
    """`rule` with each schedule that the saved rule (signature `saved`, leaf entries `entries`) holds as a
    number replaced by a placeholder of that entry's kind (a zero array of its dtype, or 0.0), into which `load`
    reads the file's value; None where the two differ otherwise (the result's structure must be the saved one).
    Hyperparameters come from the file: like= may be the run's own rule, schedules included."""
    leaves, treedef = jax.tree_util.tree_flatten(rule, is_leaf=is_schedule)
    out, i, n_leaves, it = [], 0, 0, iter(leaves)
    for token in signature(treedef):      # walks like='s nodes; the saved ones are compared at the end
        if i >= len(saved):
            return None
        if token != "*":
            i += 1
            continue
        leaf = next(it)
        sub = ["*"] if saved[i] == "*" else signature(jax.tree.structure(leaf)) if is_schedule(leaf) else None
        if sub is None or saved[i:i + len(sub)] != sub:
            return None
        if sub == ["*"] and is_schedule(leaf):
            e = entries[n_leaves] if n_leaves < len(entries) else None
            if not isinstance(e, dict) or "array" in e and e.get("shape") != []:   # a number is 0-d
                return None
            try:
                leaf = np.zeros((), dtype_named(e["dtype"], "")) if "array" in e else 0.0
            except (Malformed, KeyError):
                leaf = 0.0
        out.append(leaf)
        i += len(sub)
        n_leaves += sub.count("*")
    template = treedef.unflatten(out)
    return template if i == len(saved) and same_rule_structure(saved, template) else None
