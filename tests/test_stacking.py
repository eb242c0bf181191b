"""Stacked optimiser state (`Layout.stacks`): `update` runs each rule once per group of same-shaped parameters.
The fast path must give the numbers of the straightforward per-leaf path: every rule's own `apply` called on
each parameter alone. Bitwise where XLA computes the same expression; a few ulp where a reduction (ClipNorm's
norm, Muon's matrix products) is batched and XLA may sum in another order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
import optim._engine.stack as optim_stack
from optim._engine import fused as _fused
from optim._rules.protocol import apply_all, apply_step

from rule_cases import reduces, table

O = optim

# Every configuration of the registry (`rule_cases.py`) with a numpy reference, and those it lists for
# stacking only (`stacked`: wrappers, schedules, moment dtypes, rules that look across parameters).
RULES = [(c.id, c.make) for c in table("references")] + [(c.id, c.make) for c in table("stacked")]


def model():
    rng = np.random.default_rng(0)
    leaves = {}
    for i in range(5):
        leaves[f"m{i}"] = rng.standard_normal((3, 4)).astype(np.float32)
    for i in range(3):
        leaves[f"v{i}"] = rng.standard_normal(7).astype(np.float32)
    for i in range(2):
        leaves[f"s{i}"] = np.float32(rng.standard_normal())
    leaves["big"] = rng.standard_normal(optim_stack.STACK_MAX_SIZE + 5).astype(np.float32)
    return {k: jnp.asarray(v) for k, v in leaves.items()}


def grads(m, t):
    rng = np.random.default_rng(100 + t)
    g = {k: jnp.asarray(rng.standard_normal(np.shape(m[k])).astype(np.float32)) for k in sorted(m)}
    if t == 1:            # no gradient for some members of two groups: those rows must not advance
        g["m1"] = g["m3"] = g["v0"] = None
    return g


FROZEN = "m4"


def per_leaf_step(rule, frozen):
    """One step with each parameter alone: `rule.apply` on it (a stack of one through `apply_all` for rules
    that look across parameters), `None` and frozen meaning no step; jitted like `update`."""
    trees = hasattr(rule, "apply_tree")

    @jax.jit
    def step(r, states, xs, gs, t):
        r = optim._rules.schedules.resolve((r,), t)[0]
        live = [k for k in xs if gs[k] is not None and k != frozen]
        if trees:        # the whole model at once, one stack per leaf
            lead = lambda a: jax.tree.map(lambda v: v[None], a)
            new, steps = apply_all(r, [lead(states[k]) for k in live], [lead(xs[k]) for k in live],
                                   [(lead(gs[k]),) for k in live])
            new = [jax.tree.map(lambda v: v[0], s) for s in new]
            steps = [jax.tree.map(lambda v: v if jnp.ndim(v) == 0 else v[0], d) for d in steps]
        else:
            out = [r.apply(states[k], xs[k], gs[k]) for k in live]
            new, steps = [o[0] for o in out], [o[1] for o in out]
        states, xs = dict(states), dict(xs)
        for k, s, d in zip(live, new, steps):
            states[k] = jax.tree.map(lambda a, o: a.astype(o.dtype), s, states[k])
            xs[k] = apply_step(xs[k], d)
        return states, xs

    return step


def close_in_ulps(got, want, scale, name, what, limit):
    """|got - want| within `limit` ulp of the operands' magnitude (`scale`): a step x - s that nearly cancels
    may differ by many ulp of its tiny result, never by more than the rounding of its inputs."""
    got, want, scale = (np.asarray(v, np.float32) for v in (got, want, scale))
    tol = limit * np.spacing(np.maximum(np.maximum(np.abs(want), np.abs(scale)), np.float32(1e-30)))
    bad = ~((np.abs(got - want) <= tol) | (np.isnan(got) & np.isnan(want)))
    assert not bad.any(), f"{name}: {what}: {got[bad]} vs {want[bad]} (more than {limit} ulp)"


@pytest.fixture(autouse=True)
def xla_path(monkeypatch):
    """XLA's path on both sides: the kernel (tests/test_fused.py) does not round where XLA's fusions do."""
    monkeypatch.setattr(_fused, "ENABLED", False)


def matrix_model():
    """`model()`'s names, every leaf a matrix (for the rules of matrices only): two stacks, tall and wide."""
    rng = np.random.default_rng(1)
    shapes = {**{f"m{i}": (3, 4) for i in range(5)}, **{f"v{i}": (5, 2) for i in range(3)}}
    return {k: jnp.asarray(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}


@pytest.mark.parametrize("name, make", RULES, ids=[r[0] for r in RULES])
def test_stacked_update_equals_per_leaf_rule(name, make):
    """Every step from the same inputs: the stacked `update` and the per-leaf path agree to rounding."""
    stacked_equals_per_leaf(name, make, model())


MATRIX_RULES = [(c.id, c.make) for c in table("matrices")]


@pytest.mark.parametrize("name, make", MATRIX_RULES, ids=[r[0] for r in MATRIX_RULES])
def test_matrix_rule_stacked_equals_per_leaf(name, make):
    """The same for the rules of matrices only (`matrices` in the registry), on a model of matrices. Newton-Schulz
    amplifies a rounding difference of the batched matrix products (Polar Express's first step multiplies by ~8,
    its cubic term by ~23): the steps within 16 ulp of the parameters' scale (8 but for Polar Express with
    "aol"), NorMuon's second moments `ν` (means of `O²`, compared at their own scale) within 256 ulp (1.5e-5;
    64 with the standard coefficients)."""
    stacked_equals_per_leaf(name, make, matrix_model(), limit=16, state_limit=256)


def stacked_equals_per_leaf(name, make, m, limit=None, state_limit=None):
    state = optim.freeze(optim.setup(make(), m), FROZEN)
    assert len(state.stacks) < len(m)            # really stacked: groups of several parameters
    step = per_leaf_step(make(), FROZEN)
    states = {k: state[k].state for k in m}
    # A rule that reduces over a parameter (norms, matrix products): summation order may differ once batched.
    limit = limit or (8 if reduces(make()) else 2)
    state_limit = state_limit or limit
    for t in range(4):
        g = grads(m, t)
        state = optim.State.of_params(state.layout, state.rules, [states[p] for p in state.paths()],
                                      jnp.int32(t))
        new_state, got = optim.update(state, m, g)
        want_states, want = step(state.rules[0], states, m, g, jnp.int32(t))
        for k in m:
            if g[k] is None or k == FROZEN:
                assert got[k] is m[k]
                jax.tree.map(np.testing.assert_array_equal, new_state[k].state, states[k])
                continue
            scale = np.maximum(np.abs(np.asarray(m[k])), np.abs(np.asarray(g[k])))
            close_in_ulps(got[k], want[k], scale, name, f"step {t + 1}, parameter {k}", limit)
            for a, b, o in zip(*(jax.tree.leaves(v) for v in (new_state[k].state, want_states[k], states[k]))):
                o = np.abs(np.asarray(o, np.float32))
                close_in_ulps(a, b, np.maximum(o, scale) if o.shape == scale.shape else o, name,
                              f"step {t + 1}, state of {k}", state_limit)
        states, m = want_states, want


def test_muon_stacked_equals_per_leaf():
    rng = np.random.default_rng(3)
    m = {f"w{i}": jnp.asarray(rng.standard_normal((6, 4)).astype(np.float32)) for i in range(4)}
    state = optim.setup(optim.Muon(0.02), m)
    assert len(state.stacks) == 1
    g = {k: jnp.asarray(rng.standard_normal((6, 4)).astype(np.float32)) for k in m}
    state, got = optim.update(state, m, g)
    rule = optim.Muon(0.02)
    for k in m:
        s, d = jax.jit(rule.apply)(rule.init(m[k]), m[k], g[k])
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(m[k] - d), rtol=0, atol=2e-7)


def test_groups_follow_rule_shape_dtype_and_size(monkeypatch):
    monkeypatch.setattr(optim_stack, "STACK_MAX_MEMBERS", 2)
    m = {"a": jnp.ones(3), "b": jnp.ones(3), "c": jnp.ones(3), "d": jnp.ones(3, jnp.bfloat16),
         "e": jnp.ones(4)}
    m["big"], m["big2"] = jnp.ones(optim_stack.STACK_MAX_SIZE + 1), jnp.ones(optim_stack.STACK_MAX_SIZE + 1)
    state = optim.setup(lambda path, x: optim.Adam() if path != "e" else optim.Momentum(), m)
    groups = [[state.layout.paths[state.layout.params[u].canonical] for u in g] for g in state.layout.stacks]
    assert groups == [["a", "b"], ["big"], ["big2"], ["c"], ["d"], ["e"]]
    # chunked groups, a partial step in each: equal to per-leaf numbers
    g = {k: jnp.full(v.shape, 0.5, v.dtype) for k, v in m.items()}
    g["b"] = None
    s1, m1 = optim.update(state, m, g)
    assert m1["b"] is m["b"]
    np.testing.assert_array_equal(np.asarray(s1["b"].state[2]), np.asarray(state["b"].state[2]))
    for k in "ac":
        np.testing.assert_array_equal(np.asarray(m1[k]), np.asarray(m1["big"][:3]))


def test_state_getitem_slices_through_batch_axes():
    m = {"a": jnp.ones(2), "b": jnp.full(2, 2.0)}
    state = optim.setup(optim.Momentum(0.1), m)
    state, m = optim.update(state, m, {"a": jnp.ones(2), "b": jnp.full(2, 3.0)})
    twice = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), state)      # as vmap / pmap see it
    np.testing.assert_allclose(np.asarray(twice["b"].state), [[0.3, 0.3], [0.6, 0.6]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state["b"].state), [0.3, 0.3], rtol=1e-6)


def test_setup_of_many_small_leaves_stores_few_arrays():
    m = {f"l{i}": jnp.zeros((4, 4)) for i in range(200)}
    state = optim.setup(optim.Adam(), m)
    assert len(state.stacks) == -(-200 // optim_stack.STACK_MAX_MEMBERS)
    assert len(jax.tree.leaves(state)) < 20
    # each group's fresh state is one read-only host buffer, no copy per member
    mu = state.stacks[0][0]
    assert isinstance(mu, np.ndarray) and mu.strides[0] == 0 and not mu.flags.writeable


class _Iota(optim.Rule):       # an init that is not one value: computed on the host
    def init(self, x):
        return {"i": jnp.arange(x.size, dtype=x.dtype).reshape(x.shape), "z": jnp.zeros_like(x)}

    def apply(self, state, x, dx, *dxs):
        return state, dx


class _Nested(optim.Rule):     # an init with a nested jit: run as it is
    def init(self, x):
        return jax.jit(lambda y: jnp.full_like(y, 2.0))(x)

    def apply(self, state, x, dx, *dxs):
        return state, dx


@pytest.mark.parametrize("rule", [optim.Adam(0.1, mu_dtype=jnp.bfloat16), optim.AdaGrad(), optim.Adafactor(0.1),
                                  optim.chain(optim.ClipGlobalNorm(1.0), optim.Lion()), _Iota(), _Nested()],
                         ids=lambda r: type(r).__name__)
def test_setup_traces_the_init_and_allocates_no_filled_array(rule):
    """`setup` traces an init that reads nothing instead of running it: an array filled with one value is a
    read-only zero-stride view of it (no memory until the first `update` puts it on the device), anything else is
    computed; the values, dtypes and shapes are `rule.init`'s, and the first step runs from them."""
    x = jnp.ones((300, 200))
    state = optim.setup(rule, {"w": x})
    got, want = jax.tree.leaves(state["w"].state), jax.tree.leaves(rule.init(x))
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The stored stacks (leading member axis) of more than a few numbers that hold one value throughout.
    filled = [a for a in jax.tree.leaves(state.stored)
              if isinstance(a, np.ndarray) and a[0].size > 2 and (a[0] == a[0].flat[0]).all()]
    if not isinstance(rule, _Nested):
        assert filled and all(set(a.strides[1:]) == {0} and not a.flags.writeable for a in filled)
    new_state, new = optim.update(state, {"w": x}, {"w": jnp.full_like(x, 0.5)})
    jax.block_until_ready(new)


def test_whole_model_rule_applied_to_one_leaf_directly():
    """`apply` of a rule built on `apply_tree` runs it on a stack of one; SkipNonFinite's gate is shared (0-d)."""
    rule = optim.SkipNonFinite(optim.Adam(0.1))
    x = jnp.ones(3)
    state, step = rule.apply(rule.init(x), x, jnp.array([1.0, jnp.nan, 1.0]))
    np.testing.assert_array_equal(np.asarray(apply_step(x, step)), [1, 1, 1])
    assert int(state[1]) == 1
    _, step = rule.apply(rule.init(x), x, jnp.ones(3))
    np.testing.assert_allclose(np.asarray(apply_step(x, step)), [0.9] * 3, rtol=1e-6)


def test_param_states_give_per_parameter_states():
    m = {"a": jnp.ones(2), "b": jnp.ones(2), "c": jnp.ones(3)}
    state = optim.setup(optim.Momentum(0.1), m)
    state, _ = optim.update(state, m, {"a": jnp.ones(2), "b": jnp.full(2, 2.0), "c": jnp.ones(3)})
    assert len(state.stacks) == 2 and len(state.param_states()) == 3
    np.testing.assert_allclose(np.asarray(state.param_states()[1]), [0.2, 0.2], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state["b"].state), [0.2, 0.2], rtol=1e-6)
