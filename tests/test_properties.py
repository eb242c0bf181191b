"""Property-based tests of `optim.update` over random nested pytrees (hypothesis).

Each example is a random model built from dicts, lists, tuples, a NamedTuple and a `register_dataclass` type,
with small float32 parameters (jax or numpy arrays, shapes up to rank 2, at most 4 elements), non-trainable
leaves (ints, floats, strings, int / bool arrays, None), random ties (one array object at several positions, and
sometimes an explicit `ties={path: canonical}` between two different arrays), gradient trees where random subtrees /
leaves are None, random frozen parameters, and Descent / Momentum / Adam (the last two keep state).

Invariants (one test each):
1. tied positions stay tied (eagerly: the same object; under jit: equal values);
2. no-gradient and frozen parameters keep their value (eagerly: their object) and their optimiser state;
   non-trainable leaves come back as the same objects;
3. a tied parameter steps exactly like a lone parameter given the sum of its group's gradients (parameters of
   equal shape share a stacked state, `Layout.stacks`, often with some rows not stepping: this also checks the
   stacked path against a stack of one and against a float64 formula);
4. eager `update` agrees with `jax.jit(optim.update)` (and `eqx.filter_jit` for models with Python leaves);
5. the model, gradient trees and state passed in are never modified.

jit compiles once per structure, so trees are kept small. PROP_EXAMPLES=500 runs a longer search.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optim

SETTINGS = settings(max_examples=int(os.environ.get("PROP_EXAMPLES", 30)), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

MAX_GROUPS = 3      # distinct parameters a skeleton may refer to
MAX_LEAVES = 8      # leaves per skeleton (before the wrapper that guarantees a parameter)


# ------------------------------------------------------------------------------------------ tree types
@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "y"], meta_fields=["tag"])
@dataclasses.dataclass
class Pair:
    x: Any
    y: Any
    tag: str = "pair"


class Triple(NamedTuple):
    p: Any
    q: Any
    r: Any


# ------------------------------------------------------------------------------------------ skeletons
# A skeleton is a model whose leaves are slots: `P(g)` is a position of tie group (parameter) `g`,
# `N(kind)` a non-trainable leaf. Every P(g) of one example is materialised as the *same* array object.

@dataclasses.dataclass(frozen=True)
class P:
    g: int


@dataclasses.dataclass(frozen=True)
class N:
    kind: str


NONTRAIN_ALL = ("int", "float", "str", "intarr", "boolarr", "none")
NONTRAIN_JIT = ("int", "float", "intarr", "boolarr", "none")   # leaves plain jax.jit accepts as arguments


def _children(node):
    """`[(key, child), ...]` for a container, None for a leaf. Keys are the contract's dotted-path parts."""
    if isinstance(node, dict):
        return [(str(k), v) for k, v in node.items()]
    if isinstance(node, Pair):
        return [("x", node.x), ("y", node.y)]
    if isinstance(node, Triple):
        return list(zip(Triple._fields, node))
    if isinstance(node, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(node)]
    return None


def _remake(node, values):
    if isinstance(node, dict):
        return dict(zip(node.keys(), values))
    if isinstance(node, Pair):
        return Pair(*values, tag=node.tag)
    if isinstance(node, Triple):
        return Triple(*values)
    return type(node)(values)


def _join(path: str, key: str) -> str:
    return key if not path else f"{path}.{key}"


def _walk(node, path=""):
    """Every node of a skeleton with its dotted path, parents first."""
    yield path, node
    for k, c in _children(node) or ():
        yield from _walk(c, _join(path, k))


def _build(node, leaf, prune=frozenset(), path=""):
    """Map a skeleton to a tree: `leaf(path, slot)` at slots, None at pruned paths."""
    if path in prune:
        return None
    kids = _children(node)
    if kids is None:
        return leaf(path, node)
    return _remake(node, [_build(c, leaf, prune, _join(path, k)) for k, c in kids])


def _dotted(keypath) -> str:
    parts = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            raise AssertionError(f"unexpected key {k!r}")
    return ".".join(parts)


def by_path(tree) -> dict[str, Any]:
    """`{dotted path: leaf}` of a model (None is an empty subtree, as in JAX)."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_dotted(kp): leaf for kp, leaf in pairs}


def _prefixes(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


def _nontrainable(kind: str):
    # A fresh object per position, so that "same object back" is meaningful.
    return {"int": lambda: 7, "float": lambda: 0.5, "str": lambda: "frozen-text",
            "intarr": lambda: jnp.arange(3, dtype=jnp.int32), "boolarr": lambda: jnp.array([True, False]),
            "none": lambda: None}[kind]()


RULES = {"Descent": lambda: optim.Descent(0.1), "Momentum": lambda: optim.Momentum(0.1),
         "Adam": lambda: optim.Adam(0.1)}


@dataclasses.dataclass
class Case:
    skel: Any
    model: Any
    initial: dict           # path of a trainable position -> the array object the model holds there
    shapes: dict            # slot group -> shape
    params: list            # [(path, group)] in flatten order; an explicit tie merges two slot groups
    ties: dict              # explicit ties passed to setup, {path: canonical path} (at most one here)
    nontrain: dict          # path -> non-trainable leaf object (None leaves are not listed: not JAX leaves)
    none_paths: frozenset   # gradient-tree nodes replaced by None
    nt_grad: dict           # path of a non-trainable leaf -> what its gradient holds ("same", "junk", "float0")
    frozen: list            # paths passed to optim.freeze
    steps: int
    rule: str
    seed: int

    def __repr__(self):  # hypothesis prints this for a failing example: keep it readable
        return (f"Case(skel={self.skel!r}, shapes={self.shapes}, ties={self.ties}, "
                f"none_paths={sorted(self.none_paths)}, "
                f"nt_grad={self.nt_grad}, frozen={self.frozen}, steps={self.steps}, rule={self.rule!r}, "
                f"seed={self.seed})")

    # -- derived facts
    def members(self, g: int) -> list[str]:
        return [p for p, h in self.params if h == g]

    def groups(self) -> list[int]:
        return sorted({g for _, g in self.params}, key=lambda g: self.members(g)[0])

    def canonical(self, g: int) -> str:
        """The target of an explicit tie, else the first member in flatten order."""
        members = self.members(g)
        return next((d for d in self.ties.values() if d in members), members[0])

    def ordered(self, g: int) -> list[str]:
        """Members as the contract orders them: the canonical one first, then flatten order."""
        c = self.canonical(g)
        return [c] + [m for m in self.members(g) if m != c]

    def has_grad(self, path: str) -> bool:
        return not any(q in self.none_paths for q in _prefixes(path))

    def is_frozen(self, g: int) -> bool:
        # freeze(path) matches the path and everything below it; any frozen member freezes the group
        return any(m == f or m.startswith(f + ".") or f == "" for m in self.members(g) for f in self.frozen)

    def active(self, g: int) -> bool:
        return not self.is_frozen(g) and any(self.has_grad(m) for m in self.members(g))

    # -- inputs
    def grads(self, k: int):
        """Gradient tree for step k (fixed None pattern, fresh values) and `{param path: gradient or None}`."""
        rng = np.random.default_rng([self.seed, k + 1])
        per_path = {}

        def leaf(path, slot):
            if isinstance(slot, P):
                g = rng.normal(size=self.shapes[slot.g]).astype(np.float32)
                g = g if rng.random() < 0.2 else jnp.asarray(g)       # numpy gradients are fine too
                per_path[path] = g
                return g
            how = self.nt_grad.get(path)
            if slot.kind == "none" or how is None:
                return None
            if how == "same":
                return self.nontrain[path]
            if how == "float0":
                return np.zeros(np.shape(self.nontrain[path]), dtype=jax.dtypes.float0)
            return jnp.zeros(5, jnp.float32)     # junk: ignored at a non-trainable position

        tree = _build(self.skel, leaf, self.none_paths)
        return tree, {p: per_path.get(p) for p, _ in self.params}

    def setup(self):
        state = optim.setup(RULES[self.rule](), self.model, ties=self.ties or None)
        for f in self.frozen:
            state = optim.freeze(state, f)
        return state


_KEYS = "abcd"


def _draw_tree(draw, slot, depth: int, budget: list, root: bool = False):
    """A random skeleton of at most `depth` container levels and about `budget[0]` slots.
    (Hand-rolled rather than st.recursive, which mostly draws one-leaf trees.)"""
    if depth == 0 or budget[0] <= 0 or draw(st.integers(0, 19)) >= (19 if root else 12):
        budget[0] -= 1
        return draw(slot)
    kind = draw(st.sampled_from(["dict", "list", "tuple", "pair", "triple"]))
    if kind in ("pair", "triple"):
        kids = [_draw_tree(draw, slot, depth - 1, budget) for _ in range(2 if kind == "pair" else 3)]
        return Pair(*kids) if kind == "pair" else Triple(*kids)
    n = draw(st.sampled_from([2, 3, 1] if root else [2, 1, 3, 0]))
    if kind == "dict":
        keys = draw(st.lists(st.sampled_from(_KEYS), min_size=n, max_size=n, unique=True))
        return {k: _draw_tree(draw, slot, depth - 1, budget) for k in keys}
    kids = [_draw_tree(draw, slot, depth - 1, budget) for _ in range(n)]
    return kids if kind == "list" else tuple(kids)


_shape = st.one_of(
    st.just(()),
    st.tuples(st.integers(1, 4)),
    st.tuples(st.integers(1, 4), st.integers(1, 4)).filter(lambda s: s[0] * s[1] <= 4),
)


@st.composite
def cases(draw, jittable: bool = False):
    kinds = NONTRAIN_JIT if jittable else NONTRAIN_ALL
    param = st.builds(P, st.integers(0, MAX_GROUPS - 1))   # few groups for several positions: ties are common
    slot = st.one_of(param, param, st.sampled_from(kinds).map(N))
    skel = _draw_tree(draw, slot, depth=3, budget=[MAX_LEAVES], root=True)
    if not any(isinstance(n, P) for _, n in _walk(skel)):
        skel = {"p": P(draw(st.integers(0, MAX_GROUPS - 1))), "rest": skel}
    present = sorted({n.g for _, n in _walk(skel) if isinstance(n, P)})
    explicit = None          # (src slot group, dst slot group) of an explicit tie between different arrays
    if len(present) >= 2 and draw(st.booleans()):
        src, dst = draw(st.lists(st.sampled_from(present), min_size=2, max_size=2, unique=True))
        explicit = (src, dst)
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    shapes, arrays = {}, {}
    for g in range(MAX_GROUPS):
        shapes[g] = draw(_shape)
    if explicit:
        shapes[explicit[0]] = shapes[explicit[1]]
    for g in range(MAX_GROUPS):
        value = rng.normal(size=shapes[g]).astype(np.float32)   # explicitly tied arrays differ in value
        numpy_leaf = draw(st.integers(0, 4)) == 4       # sometimes a (mutable!) numpy parameter
        arrays[g] = value if numpy_leaf else jnp.asarray(value)

    params, nontrain, initial = [], {}, {}

    def leaf(path, s):
        if isinstance(s, P):
            params.append((path, s.g))
            initial[path] = arrays[s.g]
            return arrays[s.g]
        x = _nontrainable(s.kind)
        if x is not None:
            nontrain[path] = x
        return x

    model = _build(skel, leaf)
    # _build visits dicts in insertion order; the contract's order is JAX's flatten order
    order = list(by_path(model))
    params.sort(key=lambda pg: order.index(pg[0]))
    ties = {}
    if explicit:
        src, dst = explicit
        ties[draw(st.sampled_from([p for p, g in params if g == src]))] = \
            draw(st.sampled_from([p for p, g in params if g == dst]))
        params = [(p, dst if g == src else g) for p, g in params]

    none_paths, nt_grad = set(), {}
    none_rate = draw(st.sampled_from([0, 2, 5]))    # in twentieths, per node of the gradient tree
    for path, node in _walk(skel):
        if isinstance(node, N) and node.kind == "none":
            continue
        if draw(st.integers(0, 19)) < none_rate:
            none_paths.add(path)
        elif isinstance(node, N):
            options = ["same", "junk"] + (["float0"] if node.kind == "intarr" and not jittable else [])
            nt_grad[path] = draw(st.sampled_from(options))
    param_paths = [p for p, _ in params]
    n_frozen = draw(st.sampled_from([0, 1, 1, 2]))
    frozen = draw(st.lists(st.sampled_from(param_paths), min_size=min(n_frozen, len(set(param_paths))),
                           max_size=n_frozen, unique=True))
    steps = draw(st.integers(1, 3))
    rule = draw(st.sampled_from(sorted(RULES)))
    return Case(skel, model, initial, shapes, params, ties, nontrain, frozenset(none_paths), nt_grad, frozen,
                steps, rule, seed)


# ------------------------------------------------------------------------------------------ helpers
def run(case: Case, update=optim.update):
    """`[(state, model)]` after setup and after each step."""
    state, model = case.setup(), case.model
    out = [(state, model)]
    for k in range(case.steps):
        state, model = update(state, model, case.grads(k)[0])
        out.append((state, model))
    return out


def _np(x):
    return np.asarray(x)


def assert_tree_equal(a, b, msg=""):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"{msg}: structure {ta} != {tb}"
    for x, y in zip(la, lb):
        if isinstance(x, (jax.Array, np.ndarray)):
            np.testing.assert_array_equal(_np(x), _np(y), err_msg=msg)
        else:
            assert x == y, msg


def assert_tree_close(a, b, msg="", rtol=1e-6, atol=1e-7):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"{msg}: structure {ta} != {tb}"
    for x, y in zip(la, lb):
        if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(_np(x).dtype, jnp.inexact):
            np.testing.assert_allclose(_np(x), _np(y), rtol=rtol, atol=atol, err_msg=msg)
        else:
            assert_tree_equal(x, y, msg)


def numpy_reference(rule: str, x0, grads: list):
    """The rule's formula in float64 numpy: returns the parameter after each gradient in `grads`."""
    x, lr = np.asarray(x0, np.float64), 0.1
    m = np.zeros_like(x)
    v = np.zeros_like(x)
    out = []
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float64)
        if rule == "Descent":
            x = x - lr * g
        elif rule == "Momentum":
            m = 0.9 * m + lr * g
            x = x - m
        else:
            b1, b2 = 0.9, 0.999
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            x = x - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + 1e-8)
        out.append(x)
    return out


# ------------------------------------------------------------------------------------------ properties
@SETTINGS
@given(cases(), st.booleans())
def test_tied_positions_stay_tied(case, jitted):
    history = run(case, eqx.filter_jit(optim.update) if jitted else optim.update)
    for step, (state, model) in enumerate(history[1:], start=1):
        leaves = by_path(model)
        for g in case.groups():
            c, *others = case.ordered(g)
            for m in others:
                where = f"step {step}: {m} tied to {c}"
                if not case.active(g):
                    # no step: every position keeps what it held (explicitly tied arrays may differ)
                    assert (_np(leaves[m]) == _np(case.initial[m])).all() if jitted else \
                        leaves[m] is case.initial[m], where
                elif jitted:
                    np.testing.assert_array_equal(_np(leaves[m]), _np(leaves[c]), err_msg=where)
                else:
                    assert leaves[m] is leaves[c], where + ": not the same object"
                # state[member] is the canonical parameter's leaf
                assert_tree_equal(state[m].state, state[c].state, f"state[{m!r}] vs state[{c!r}]")
                assert state[m].frozen == state[c].frozen
            assert set(state.ties().get(c, ())) == set(others)


@SETTINGS
@given(cases())
def test_no_gradient_and_frozen_parameters_are_untouched(case):
    history = run(case)
    state0, model0 = history[0]
    for step, (state, model) in enumerate(history[1:], start=1):
        leaves = by_path(model)
        for g in case.groups():
            c = case.canonical(g)
            assert state[c].frozen == case.is_frozen(g)
            if case.active(g):
                continue
            for m in case.members(g):
                assert leaves[m] is case.initial[m], f"step {step}: {m}: no gradient / frozen, yet a new object"
            assert_tree_equal(state[c].state, state0[c].state,
                              f"step {step}: state of {c} advanced without a gradient / while frozen")
        for p, x in case.nontrain.items():
            assert leaves[p] is x, f"non-trainable leaf {p} did not come back as the same object"
        assert jax.tree_util.tree_structure(model) == jax.tree_util.tree_structure(model0)


@SETTINGS
@given(cases())
def test_tied_update_equals_single_parameter_with_summed_gradient(case):
    history = run(case)
    grads = [case.grads(k)[1] for k in range(case.steps)]
    for g in case.groups():
        if not case.active(g):
            continue
        members = case.ordered(g)            # canonical first: the order the contract sums in
        x0 = case.initial[members[0]]
        ref_state = optim.setup(RULES[case.rule](), {"w": x0})
        ref = {"w": x0}
        sums = []
        for k in range(case.steps):
            parts = [grads[k][m] for m in members if grads[k][m] is not None]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            sums.append(total)
            ref_state, ref = optim.update(ref_state, ref, {"w": total})
            state, model = history[k + 1]
            leaves = by_path(model)
            for m in members:
                np.testing.assert_allclose(_np(leaves[m]), _np(ref["w"]), rtol=1e-6, atol=1e-7,
                                           err_msg=f"step {k + 1}, {m} (group of {members[0]})")
            assert_tree_close(state[members[0]].state, ref_state["w"].state,
                              f"step {k + 1}, optimiser state of {members[0]}")
        # and independently of optim: the rule's formula in float64 on the summed gradient
        expect = numpy_reference(case.rule, x0, sums)
        for k in range(case.steps):
            got = by_path(history[k + 1][1])[members[0]]
            np.testing.assert_allclose(_np(got), expect[k], rtol=1e-5, atol=1e-5,
                                       err_msg=f"step {k + 1}, {members[0]} vs float64 formula")


@SETTINGS
@given(cases(jittable=True))
def test_eager_equals_jax_jit(case):
    eager = run(case)
    jitted = run(case, jax.jit(optim.update))
    for k, ((se, me), (sj, mj)) in enumerate(zip(eager, jitted)):
        assert jax.tree_util.tree_structure(me) == jax.tree_util.tree_structure(mj)
        assert sj.layout == se.layout
        assert_tree_close(mj, me, f"model after step {k}")
        assert_tree_close(jax.tree_util.tree_leaves(sj), jax.tree_util.tree_leaves(se), f"state after step {k}")


@SETTINGS
@given(cases())
def test_eager_equals_filter_jit_with_python_leaves(case):
    eager = run(case)
    jitted = run(case, eqx.filter_jit(optim.update))
    for k, ((se, me), (sj, mj)) in enumerate(zip(eager, jitted)):
        assert sj.layout == se.layout
        assert_tree_close(mj, me, f"model after step {k}")
        assert_tree_close(jax.tree_util.tree_leaves(sj), jax.tree_util.tree_leaves(se), f"state after step {k}")


def _snapshot(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, leaves, [np.array(x, copy=True) if isinstance(x, (jax.Array, np.ndarray)) else None
                             for x in leaves]


def _assert_unchanged(tree, snap, what):
    treedef, leaves, values = snap
    now, now_def = jax.tree_util.tree_flatten(tree)
    assert now_def == treedef, f"{what}: structure changed"
    assert len(now) == len(leaves)
    for x, y, v in zip(now, leaves, values):
        assert x is y, f"{what}: a leaf was replaced in place"
        if isinstance(x, jax.Array):
            assert not x.is_deleted(), f"{what}: an input buffer was donated / deleted"
        if v is not None:
            np.testing.assert_array_equal(np.asarray(x), v, err_msg=f"{what}: a leaf's values changed")


@SETTINGS
@given(cases(), st.sampled_from(["eager", "filter_jit"]))
def test_inputs_are_never_modified(case, mode):
    update = optim.update if mode == "eager" else eqx.filter_jit(optim.update)
    state = case.setup()
    model = case.model
    for k in range(case.steps):
        grads = case.grads(k)[0]
        snaps = [_snapshot(model), _snapshot(grads), _snapshot(state)]
        layout = state.layout
        new_state, new_model = update(state, model, grads)
        _assert_unchanged(model, snaps[0], "model")
        _assert_unchanged(grads, snaps[1], "grads")
        _assert_unchanged(state, snaps[2], "state")
        assert state.layout is layout
        # pure: the same inputs again give the same outputs
        again_state, again_model = update(state, model, grads)
        assert_tree_equal(again_model, new_model, "second call with the same inputs")
        assert_tree_equal(jax.tree_util.tree_leaves(again_state), jax.tree_util.tree_leaves(new_state),
                          "second call with the same inputs (state)")
        state, model = new_state, new_model
