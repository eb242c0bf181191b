"""Packed small state leaves (`optim._engine.pack`) and hoisted scalar arithmetic (`optim._engine.hoist`).

Packing changes only how the state is stored, and hoisting only where XLA computes a rule's per-parameter
numbers: every result must equal the plain path (each stack runs its whole rule, `_hoist.ENABLED = False`) to
a few ulp of each array's scale, through `None` gradients, frozen and tied parameters, stacked and single
groups. The compiled program is checked for size (kernels and copies per parameter, against optax's), not for time.
"""

import os
import pathlib
import subprocess
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from bench.program import entry_counts
from optim._engine import fused as _fused, hoist as _hoist, pack as _pack

BIG = 8200          # above optim._engine.stack.STACK_MAX_SIZE: each such parameter is alone in its stack


@pytest.fixture(autouse=True)
def xla_path(monkeypatch):
    """These tests are about XLA's path: on CPU, Adam would otherwise run in optim's kernel (tests/test_fused.py)."""
    monkeypatch.setattr(_fused, "ENABLED", False)


def model(dtype=jnp.float32):
    """The test model (also tests/test_fused.py's), in `dtype`."""
    k = iter(jax.random.split(jax.random.PRNGKey(0), 12))
    emb = jax.random.normal(next(k), (BIG,), dtype)
    return {"emb": emb, "head": emb,                                              # tied
            "big": [jax.random.normal(next(k), (BIG,), dtype) for _ in range(3)],  # alone in their stacks
            "mat": jax.random.normal(next(k), (90, 100), dtype),                   # alone, another shape
            "small": [jax.random.normal(next(k), (5,), dtype) for _ in range(4)],   # one stack of 4
            "s": jnp.asarray(0.5, dtype)}                                          # a scalar


def grads_at(t, m):
    g = jax.tree.map(lambda a: (jnp.cos(a * (t + 1)) * 0.3 + 0.01 * t).astype(a.dtype), m)
    if t % 3 == 1:
        g["big"][1] = None                   # one single-member stack does not step
        g["small"][2] = None                 # one row of a stack does not step
    if t % 3 == 2:
        g["emb"] = None                      # half a tie still steps (the head's gradient)
    return g


# Several rules per model (`by_path`) to keep the compiles few: each rule has stacks and packs of its own.
BELIEF, ADAMAX = optim.AdaBelief(0.01), optim.AdaMax(0.01)
RULES = {
    "Adam family": optim.by_path({"big.0": optim.Adam(0.01), "big.1": optim.NAdam(0.01), "big.2": optim.RAdam(0.01),
                                  "mat": optim.Lamb(0.01), "emb": BELIEF, "head": BELIEF,
                                  "*": optim.Adam(0.01, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)}),
    "Muon, Adafactor, AdaMax, a schedule": optim.by_path({
        "mat": optim.Muon(0.01), "big.*": optim.Adafactor(0.01, momentum=0.9), "emb": ADAMAX, "head": ADAMAX,
        "*": optim.Adam(optim.WSD(0.01, 2, 2, 4), eps=optim.Exponential(1e-3, 0.5, 2))}),
    "chain(AccumGrad, Adam)": optim.chain(optim.AccumGrad(2), optim.Adam(0.01)),
    "EMA(Adam)": optim.EMA(optim.Adam(0.01), 0.9),
    "chain(ClipGlobalNorm, Adam)": optim.chain(optim.ClipGlobalNorm(1.0), optim.Adam(0.01)),
    "chain(ClipNorm, OAdam, Scale)": optim.chain(optim.ClipNorm(1.0), optim.OAdam(0.01), optim.Scale(0.5)),
}


def train(rule, steps=3, freeze=None):
    m = model()
    state = optim.setup(rule, m)
    if freeze:
        state = optim.freeze(state, freeze)
    for t in range(steps):       # eagerly: update compiles its own program per gradient structure, and per path
        state, m = optim.update(state, m, grads_at(t, m))
    return state, m


def assert_ulp(a, b, ulps=4):
    """Equal to within a few ulp of each array's scale (its largest magnitude). Only XLA's choices differ between
    the paths (where a fusion ends, hence where a multiply-add is contracted), which moves a result by an ulp;
    near zero, in cancelling sums such as a moment's `β m + (1 - β) g`, one ulp of the inputs is many of the
    result's own."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if not np.issubdtype(x.dtype, np.inexact) and x.dtype != jnp.bfloat16:
            np.testing.assert_array_equal(x, y)
            continue
        eps = float(jnp.finfo(x.dtype).eps)
        x, y = x.astype(np.float64), y.astype(np.float64)
        np.testing.assert_allclose(x, y, rtol=ulps * eps, atol=ulps * eps * max(np.abs(y).max(), 1e-30))


@pytest.fixture
def plain(monkeypatch):
    def run(*args, **kw):
        with monkeypatch.context() as mp:
            mp.setattr(_hoist, "ENABLED", False)
            return train(*args, **kw)
    return run


# Rules that look across parameters run per stack, reading and writing their packed rows (except the leading
# stateless stages of a chain, `ClipGlobalNorm`: they run first, and the rest of the chain is hoisted); that path
# is every `SkipNonFinite` / `SkipLargeUpdates` test's (tests/test_global_rules.py).
NOT_HOISTED: set = set()


@pytest.mark.parametrize("name", list(RULES))
def test_hoisted_equals_plain(name, plain, monkeypatch):
    rule = RULES[name]
    want_state, want_model = plain(rule, freeze="big.2")
    hoisted = []
    run = _hoist.run

    def counted(*args):
        out = run(*args)
        hoisted.extend(r for r in out[0] if r is not None)
        return out

    monkeypatch.setattr(_hoist, "run", counted)
    state, m = train(rule, freeze="big.2")
    assert_ulp(m, want_model)
    assert_ulp(state.stacks, want_state.stacks)
    assert m["emb"] is m["head"]
    assert bool(hoisted) == (name not in NOT_HOISTED)


def test_adam_state_is_packed_and_reads_back():
    state = optim.setup(optim.Adam(0.01), model())
    # Stacks: emb, big.0-2 and mat alone (above 8192 elements), the 4 small vectors, the scalar. Every stack's bt
    # is packed (the scalar's too: its bt has shape (2,), not the parameter's ()): the six single-member stacks'
    # rows in one pack, the stack of 4's in another (packs hold stacks of one size).
    assert all(isinstance(s.bt, _pack.Packed) for s in state.stored)
    assert [np.shape(a) for a in jax.tree.leaves(state.packs)] == [(6, 2), (4, 2)]
    assert len(jax.tree.leaves(state)) == 4 + 2 * len(state.stored) + 1 + 2   # lr, β₁, β₂, ε; moments; step; packs
    np.testing.assert_allclose(state["big.1"].state.bt, [1, 1])       # the products of the β's of no step
    state, m = optim.update(state, model(), grads_at(1, model()))    # big.1 and small.2 take no step
    np.testing.assert_allclose(state["big.1"].state.bt, [1, 1])
    np.testing.assert_allclose(state["big.0"].state.bt, [0.9, 0.999], rtol=1e-6)
    np.testing.assert_allclose(state["small.2"].state.bt, [1, 1])
    np.testing.assert_allclose(state["small.3"].state.bt, [0.9, 0.999], rtol=1e-6)


def test_packs_hold_at_most_64_rows():
    m = {f"w{i}": jnp.full((BIG,), float(i)) for i in range(70)}
    state = optim.setup(optim.Adam(0.01), m)
    assert [np.shape(p[0]) for p in state.packs] == [(64, 2), (6, 2)]
    state, m2 = optim.update(state, m, {k: (None if k == "w65" else jnp.ones(BIG)) for k in m})
    assert [np.shape(p[0]) for p in state.packs] == [(64, 2), (6, 2)]
    np.testing.assert_allclose(state["w65"].state.bt, [1, 1])
    np.testing.assert_allclose(state["w66"].state.bt, [0.9, 0.999], rtol=1e-6)


def test_vmapped_state_reads_back():
    m = {"a": jnp.ones(BIG), "b": jnp.ones(BIG)}
    state = optim.setup(optim.Adam(0.1), m)
    two = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), state)       # batch axes in front of the packs
    assert np.shape(two["b"].state.bt) == (2, 2)
    np.testing.assert_allclose(two["b"].state.bt[1], [2, 2])


def test_the_state_declares_its_small_leaves():
    """Which leaves are small is the state class's to say (`AdamState`'s `bt: Small`), not their shape: a
    2-element parameter's `bt`, shaped like it, is packed as a 3-element one's is (it was stored per stack, and
    the kernel then refused every stack of the rule). Declarations are read at any depth of a state."""
    state = optim.setup(optim.Adam(0.01), {"a": jnp.ones(3), "b": jnp.ones(2)})
    assert all(isinstance(s.bt, _pack.Packed) for s in state.stored)
    assert [np.shape(a) for a in jax.tree.leaves(state.packs)] == [(2, 2)]
    np.testing.assert_allclose(state["b"].state.bt, [1, 1])
    # EMAState(RAdamState(mu, nu, bt, t), average): RAdam declares bt and t, EMA nothing
    assert _pack.declared_small(optim.EMA(optim.RAdam(0.01)).init(jnp.ones(2))) == [False, False, True, True, False]
    assert _pack.declared_small({"count": jnp.zeros((), jnp.int32), "v": jnp.ones(2)}) == [False, False]


_SHARDED_TINY = """
import jax, jax.numpy as jnp, numpy as np, optim
from jax.sharding import NamedSharding, PartitionSpec as P
from optim._engine import pack
mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
m = {"a": jnp.ones(4), "b": jnp.asarray([0.5, -1.0])}
state = optim.setup(optim.Adam(0.1), m, state_sharding=lambda path, x: NamedSharding(mesh, P("d")))
assert all(isinstance(s.bt, pack.Packed) for s in state.stored)
assert [a.sharding.spec for a in jax.tree.leaves(state.packs)] == [P(None, None)]
step = jax.jit(lambda s, m, g: optim.update(s, m, g))
x = m
for _ in range(2):
    state, x = step(state, x, m)
np.testing.assert_allclose(state["b"].state.bt, [0.81, 0.998001], rtol=1e-6)
print("ok")
"""


def test_a_declared_small_leaf_of_a_sharded_state_is_packed_replicated():
    """ZeRO-1 places a stack's arrays by their shape (those shaped like the parameter are sharded as its state
    is): a 2-element parameter's `bt` comes sharded, and is packed replicated, as every pack is (joined as it came,
    the pack's pieces have different shardings; stored per stack, Adam could not slice a sharded `bt`)."""
    out = subprocess.run([sys.executable, "-c", _SHARDED_TINY], capture_output=True, text=True, timeout=600,
                         cwd=pathlib.Path(__file__).parent.parent,
                         env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert out.stdout.split() == ["ok"], out.stderr[-3000:]


class _Pair(NamedTuple):
    m: Any              # like the parameter
    c: Any              # two numbers per parameter


class _DeclaredPair(NamedTuple):
    m: Any
    c: optim.fields.Small


class _PairRule(optim.Rule):
    lr: float = 0.1
    make = _Pair

    def init(self, x):
        return self.make(jnp.zeros_like(x), jnp.ones(2, x.dtype))

    def apply(self, state, x, dx, *dxs):
        m, c = 0.9 * state.m + dx, state.c * jnp.asarray([0.5, 0.25], state.c.dtype)
        return self.make(m, c), self.lr * m * (c[0] + c[1])


class _DeclaredPairRule(_PairRule):
    make = _DeclaredPair


def test_a_state_that_declares_nothing_is_packed_by_shape():
    """A user's state that marks no field `Small`: a leaf of at most `SMALL` numbers per parameter is small when
    it is not shaped like the parameter (or not a float); one shaped like it is per element. Declaring it (the
    mark) packs it for every parameter; the steps are the same."""
    m = {"a": jnp.ones(3), "b": jnp.ones(2)}
    plain, declared = optim.setup(_PairRule(), m), optim.setup(_DeclaredPairRule(), m)
    assert sorted(isinstance(s.c, _pack.Packed) for s in plain.stored) == [False, True]     # b's c is like b
    assert all(isinstance(s.c, _pack.Packed) for s in declared.stored)
    x, y = m, m
    for t in range(3):
        g = jax.tree.map(lambda a: jnp.cos(a * (t + 1)), m)
        plain, x = optim.update(plain, x, g)
        declared, y = optim.update(declared, y, g)
    assert_ulp(y, x)
    np.testing.assert_allclose(declared["b"].state.c, [0.5 ** 3, 0.25 ** 3])
    np.testing.assert_allclose(plain["b"].state.c, [0.5 ** 3, 0.25 ** 3])


def test_small_fields_reads_the_mark():
    """`optim.fields.small_fields`: the fields a state class marks `Small`, in field order; an annotation that
    does not resolve is read as text."""
    from optim._rules.adam import AdamState, RAdamState
    from optim._rules.kron import KronState

    small_fields = optim.fields.small_fields
    assert small_fields(AdamState) == ("bt",) and small_fields(RAdamState) == ("bt", "t")
    assert small_fields(KronState) == ("update_counter", "count")
    assert small_fields(_DeclaredPair) == ("c",)
    assert small_fields(_Pair) == () and small_fields(dict) == () and small_fields(tuple) == ()
    unknown = "NotAName"      # (a variable: a literal would be read as an undefined name by the linter)
    odd = NamedTuple("Odd", [("m", unknown), ("c", "optim.fields.Small")])
    assert small_fields(odd) == ("c",)


def counts(f, *args):
    return entry_counts(f.lower(*args).compile().as_text())


def test_program_no_bigger_than_optax():
    """4 parameters of 16k floats, each alone in its stack, one user-jitted donated Adam step. Before packing:
    26 fusions, 4 copies and 25 inputs against optax's 15, 0 and 17 (a bias-correction array per parameter)."""
    m = {f"w{i}": jnp.ones(16384) * (i + 1) for i in range(4)}
    g = jax.tree.map(lambda a: a * 0.1, m)
    ours = counts(jax.jit(optim.update, donate_argnums=(0, 1)), optim.setup(optim.Adam(1e-3), m), m, g)
    tx = optax.adam(1e-3)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    theirs = counts(jax.jit(step, donate_argnums=(0, 1)), m, tx.init(m), g)
    assert theirs["fusions"] == 15 and theirs["copies"] == 0 and theirs["inputs"] == 17
    # Per parameter the same 3 kernels as optax (moments, new value); per model optax has 3 scalar kernels (count
    # and powers), optim 5 (step counter, β, the pack's new products, its two corrections, which read the new
    # products). One copy of the one pack. Inputs: optax's 16 arrays and count; optim's 16 arrays, step, pack and
    # the 4 hyperparameters.
    assert ours["fusions"] <= theirs["fusions"] + 2 and ours["copies"] <= 1 and ours["inputs"] == 22


def test_chains_program_size():
    """A chain is split at the level of the stack (traced per member it went through `apply_one`'s reshapes, and
    XLA then copied both moments of every parameter: 9 copies here), and a chain's leading `ClipGlobalNorm` runs
    first so that the rest is split too (28 fusions before; optax's chain has 24)."""
    m = {f"w{i}": jnp.ones(16384) * (i + 1) for i in range(4)}
    g = jax.tree.map(lambda a: a * 0.1, m)

    def ours(rule):
        return counts(jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1)), optim.setup(rule, m),
                      m, g)

    assert ours(optim.chain(optim.ClipNorm(1.0), optim.Adam(1e-3)))["copies"] <= 1
    assert ours(optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(1e-3, weight_decay=0.1)))["fusions"] <= 24
