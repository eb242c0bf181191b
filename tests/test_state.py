"""State: lookup (`state[path]`, `state.rule`) and its errors, repr, pytree behaviour, and a hashable static
layout that compares by value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from conftest import arr


def model():
    w = jnp.ones((2, 3))
    return {"emb": w, "layers": [{"w": jnp.ones(3), "b": jnp.zeros(1)}], "head": w, "step": 0}


def test_getitem_any_member_returns_canonical_leaf():
    s = optim.setup(optim.Adam(1e-3), model())
    assert isinstance(s["head"], optim.Leaf)
    jax.tree.map(np.testing.assert_array_equal, s["head"].state, s["emb"].state)
    assert s.layout.param("head") == s.layout.param("emb") and s["layers.0.w"].frozen is False
    assert "head" in s and "step" not in s and "nope" not in s


def test_state_getitem_errors():
    state = optim.setup(optim.Descent(), {"w": arr(1, 2), "b": arr(0.5), "n": 3})
    with pytest.raises(ValueError, match="'x' is not a leaf path"):
        state["x"]
    with pytest.raises(KeyError, match="'ww' is not a leaf path of the model; did you mean 'w'"):
        state["ww"]
    with pytest.raises(ValueError, match="'n' is not a trainable leaf"):
        state["n"]
    with pytest.raises(ValueError, match="did you mean 'w'"):
        state["w2"]
    with pytest.raises(TypeError, match=r"state\[...\] takes a dotted path string, got int"):
        state[0]


def test_repr_lists_paths_rules_shapes_frozen_and_ties():
    s = optim.freeze(optim.setup(optim.Momentum(0.1), model()), "layers.0.b")
    text = repr(s)
    assert "State(3 parameters, 4 positions)" in text
    assert "emb: float32[2, 3] Momentum(lr=0.1, rho=0.9) state=float32[2, 3]  tied: head" in text
    assert "layers.0.b: float32[1]" in text and "frozen" in text


def test_layout_is_hashable_and_compares_by_value():
    a, b = optim.setup(optim.Adam(), model()), optim.setup(optim.Adam(), model())
    assert a.layout is not b.layout and a.layout == b.layout and hash(a.layout) == hash(b.layout)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert optim.freeze(a).layout != a.layout


def test_state_equality_is_by_value_and_a_python_bool():
    """`==` compares layouts and every leaf's shape, dtype and values (NaN equal to NaN), wherever the arrays
    live; a State is unhashable (its layout stays hashable); traced states do not compare."""
    m = {"w": arr(1, 2, 3), "b": arr(0.5)}
    a, b = optim.setup(optim.Adam(0.1), m), optim.setup(optim.Adam(0.1), m)
    assert a is not b and (a == b) is True and (a != b) is False
    assert jax.tree.map(jnp.asarray, a) == a              # host (numpy) and device arrays of equal values
    g = {"w": arr(1, -1, 2), "b": arr(3)}
    a1, b1 = optim.update(a, m, g)[0], optim.update(b, m, g)[0]
    assert a1 == b1 and a1 != a
    assert a != optim.setup(optim.Adam(0.2), m)           # a hyperparameter's value
    assert a != optim.setup(optim.Momentum(0.1), m)       # another rule: another structure
    assert a != optim.freeze(a, "w")                      # the layout
    assert a != optim.setup(optim.Adam(0.1), {"w": arr(1, 2, 3)})
    assert a != jax.tree.map(lambda x: x.astype(jnp.float16) if x.dtype == jnp.float32 else x, a)   # dtypes
    assert (a == 3) is False and a != None  # noqa: E711 (another type is never equal)
    nan = {"w": arr(float("nan"), 1, 1), "b": arr(0)}
    assert optim.update(a, m, nan)[0] == optim.update(b, m, nan)[0]
    with pytest.raises(TypeError, match="unhashable type: 'State'"):
        hash(a)
    assert hash(a.layout) == hash(b.layout)
    with pytest.raises(TypeError, match="State == State compares values, which a traced state does not have"):
        jax.jit(lambda s, t: s == t)(a, b)


def test_repr_of_a_mapped_state_degrades_gracefully():
    """`jax.tree.map(f, state)` may put anything at the leaves (shapes, shardings, specs); its repr still names
    every parameter and shows what the stacks hold instead of failing."""
    s = optim.setup(optim.Adam(0.1), {"w": jnp.ones((2, 3)), "b": jnp.ones(())})
    for f in (lambda a: a.shape, lambda a: 0, lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
              lambda a: jax.sharding.PartitionSpec(), lambda a: None):
        text = repr(jax.tree.map(f, s))
        assert text.startswith("State(2 parameters, 2 positions)") and "\n  w: float32[2, 3] Adam(" in text
    specs = repr(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), s))
    assert "state=<not arrays: its stack holds float32[1, 2, 3], float32[1, 2, 3]>" in specs   # w's row of 1
    doubled = repr(jax.tree.map(lambda a: a * 2, s))      # still arrays: shown per parameter as usual
    assert "Adam(lr=0.2, beta=(1.8, 1.998), eps=2e-08) state=AdamState(mu='float32[2, 3]'" in doubled


def test_setup_inside_jit_of_grad_on_a_closed_over_model():
    """setup on a concrete model closed over by a jitted gradient: the state's constants are made as constants
    (not tracers of the outer trace), so it trains there as outside, ties included."""
    w, e = jnp.array([1.0, 2.0, 3.0]), jnp.ones(2)
    model = {"w": w, "emb": e, "head": e}
    rule = optim.by_path({"w": optim.Momentum(0.1), "*": optim.Adam(0.1)})

    def run(x):
        state = optim.setup(rule, model)
        _, new = optim.update(state, model, jax.tree.map(lambda a: a * x, model))
        return new

    def loss(x):
        new = run(x)
        return jnp.sum(new["w"]) + jnp.sum(new["emb"]) + jnp.sum(new["head"])

    np.testing.assert_allclose(jax.jit(jax.grad(loss))(2.0), jax.grad(loss)(2.0), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(2.0), -0.1 * 6.0, rtol=1e-5)   # Momentum: w - 0.1 x w
    got = jax.jit(run)(2.0)
    np.testing.assert_array_equal(got["emb"], got["head"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, run(2.0))
    # a user rule that is no pytree: its numbers stay Python floats, and its constant init is made as constants
    state = jax.jit(lambda x: optim.setup(_Pairs(), model).step + x)(1)
    assert int(state) == 1


class _Pairs:
    """A rule that is not a pytree, with a constant state made of its Python numbers."""

    b = (0.9, 0.99)

    def init(self, x):
        return jnp.stack([jnp.float32(self.b[0]), jnp.float32(self.b[1])])

    def apply(self, state, x, dx, *dxs):
        return state, dx


class _ReadsFloat:
    """A rule whose init turns a traced value into a Python float: setup traces inits, so this fails there."""

    def init(self, x):
        return jnp.full(x.shape, float(jnp.sum(x)))

    def apply(self, state, x, dx, *dxs):
        return state, dx


def test_setup_names_the_path_when_a_rule_init_trips_over_a_tracer():
    """A JAX tracer error from a rule's init (whose constructor takes the tracer, not a message) comes back as a
    TypeError naming the path, with JAX's explanation, not as an AttributeError from rebuilding the error."""
    with pytest.raises(TypeError, match=r"setup: at 'layers\.0\.w': .*[Aa]bstract tracer value"):
        optim.setup(_ReadsFloat(), {"layers": [{"w": jnp.ones(2)}]})


def test_state_is_a_pytree_of_hyperparameters_and_states():
    s = optim.setup(optim.Adam(1e-3), {"w": jnp.ones(3)})
    leaves = jax.tree.leaves(s)
    assert len(leaves) == 4 + 3 + 1  # lr, b1, b2, eps + m, v, (bt1, bt2) + the step counter
    s2 = jax.tree.map(lambda x: x, s)
    assert s2.layout is s.layout


def test_paths_items_ties():
    s = optim.setup(optim.Descent(), model())
    assert s.paths() == ["emb", "layers.0.b", "layers.0.w"]
    assert dict(s.items())["emb"].rule is s.rule
    assert s.ties() == {"emb": ("head",)}


def test_rule_property_is_unambiguous_only():
    s = optim.setup(optim.Descent(), {"w": jnp.ones(1)})
    assert isinstance(s.rule, optim.Descent)


def test_rule_property_refuses_a_state_with_several_rules():
    model = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    state = optim.setup(lambda path, x: optim.Adam(0.1) if x.ndim == 2 else optim.Descent(0.2), model)
    with pytest.raises(ValueError, match=r"this state uses several rules; look one up with state\[path\]\.rule"):
        state.rule
    # what the message points to
    assert isinstance(state["w"].rule, optim.Adam) and float(state["w"].rule.lr) == pytest.approx(0.1)
    assert isinstance(state["b"].rule, optim.Descent) and float(state["b"].rule.lr) == pytest.approx(0.2)
    # equal rules chosen per leaf are one rule: no ambiguity
    same = optim.setup(lambda path, x: optim.Adam(0.1), model)
    assert isinstance(same.rule, optim.Adam) and float(same.rule.lr) == pytest.approx(0.1)


# ----------------------------------------------------------------------------------------------- by_path
def _mlp():
    return {"layers": [{"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "bias": jnp.array([0.5, -0.5])},
                       {"w": jnp.array([[2.0, 1.0], [-1.0, 0.0]]), "bias": jnp.array([1.0, 2.0])}],
            "norm": {"scale": jnp.array([1.0, 1.0])}}


def _mlp_grads(k):
    return jax.tree.map(lambda x: jnp.cos(x * k + jnp.arange(x.size).reshape(x.shape)), _mlp())


def test_by_path_no_decay_on_biases_and_norms_matches_optax_multi_transform():
    """The common recipe: AdamW with weight decay for matrices, Adam (no decay) for biases and norm scales;
    against optax.multi_transform with the same labels, 10 steps in float64."""
    optax = pytest.importorskip("optax")
    with jax.enable_x64(True):
        model = jax.tree.map(lambda a: a.astype(jnp.float64), _mlp())
        rule = optim.by_path({"*.bias": optim.Adam(0.01), "norm": optim.Adam(0.01),
                              "*": optim.AdamW(0.01, weight_decay=0.1)})
        state, m = optim.setup(rule, model), model
        labels = {"layers": [{"w": "decay", "bias": "plain"}] * 2, "norm": {"scale": "plain"}}
        tx = optax.multi_transform({"decay": optax.adamw(0.01, weight_decay=0.1), "plain": optax.adam(0.01)},
                                   labels)
        ost, om = tx.init(model), model
        for k in range(1, 11):
            g = jax.tree.map(lambda a: a.astype(jnp.float64), _mlp_grads(k))
            state, m = optim.update(state, m, g)
            u, ost = tx.update(g, ost, om)
            om = optax.apply_updates(om, u)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12), m, om)
    assert [type(leaf.rule).__name__ for _, leaf in state.items()] == ["Adam", "AdamW", "Adam", "AdamW", "Adam"]


def test_by_path_first_match_wins_and_patterns_match_like_freeze():
    rule = optim.by_path({"layers.1": optim.Descent(1.0),          # a prefix: everything below layers.1
                          "layers.0.w": optim.Descent(2.0),        # an exact path
                          "*s.*.bias": optim.Descent(3.0),         # fnmatch; layers.1.bias matched above
                          "": optim.Descent(4.0)})                 # the empty prefix: every other leaf
    state = optim.setup(rule, _mlp())
    lrs = {p: float(leaf.rule.lr) for p, leaf in state.items()}
    assert lrs == {"layers.0.w": 2.0, "layers.0.bias": 3.0, "layers.1.w": 1.0, "layers.1.bias": 1.0,
                   "norm.scale": 4.0}


def test_by_path_unmatched_leaf_and_split_tie_group_raise_naming_paths():
    with pytest.raises(ValueError, match=r"no pattern matches the trainable leaf 'norm.scale' \(patterns: "
                                         r"'layers'\)"):
        optim.setup(optim.by_path({"layers": optim.Adam()}), _mlp())
    w = jnp.ones(2)
    with pytest.raises(ValueError, match="'emb' and 'head' are tied"):
        optim.setup(optim.by_path({"emb": optim.Adam(), "head": optim.Lion()}), {"emb": w, "head": w})
    # A tie whose members reach the same rule through different patterns is one parameter.
    rule = optim.Adam(0.1)
    state = optim.setup(optim.by_path({"emb": rule, "head": rule}), {"emb": w, "head": w, "n": 3})
    assert len(state) == 1 and state.ties() == {"emb": ("head",)}


def test_by_path_refuses_a_malformed_table():
    with pytest.raises(TypeError, match="non-empty dict"):
        optim.by_path({})
    with pytest.raises(TypeError, match="non-empty dict"):
        optim.by_path([("*", optim.Adam())])
    with pytest.raises(TypeError, match="patterns are dotted-path strings, got int 3"):
        optim.by_path({3: optim.Adam()})
    with pytest.raises(TypeError, match="the entry for '\\*' is 0.1, which is not a rule"):
        optim.by_path({"*": 0.1})


def test_by_path_state_trains_under_jit_and_saves(tmp_path):
    rule = optim.by_path({"*.bias": optim.Momentum(0.1), "*": optim.Adam(0.01)})
    model = _mlp()
    state = optim.setup(rule, model)
    step = jax.jit(optim.update)
    for k in range(3):
        state, model = step(state, model, _mlp_grads(k))
    optim.save(tmp_path / "s.optim", state)
    back = optim.load(tmp_path / "s.optim", optim.setup(rule, _mlp()))
    for p, leaf in state.items():
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), back[p].state, leaf.state)
        assert type(back[p].rule) is type(leaf.rule)


def test_scale_multiplies_the_step_and_adjusts_by_path():
    optax = pytest.importorskip("optax")
    model = _mlp()
    state = optim.setup(optim.chain(optim.Adam(0.01), optim.Scale(0.5)), model)
    tx = optax.chain(optax.adam(0.01), optax.scale(0.5))
    ost, om, m = tx.init(model), model, model
    for k in range(1, 4):
        state, m = optim.update(state, m, _mlp_grads(k))
        u, ost = tx.update(_mlp_grads(k), ost, om)
        om = optax.apply_updates(om, u)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), m, om)
    state = optim.adjust(state, "norm", f=-1.0)        # a negative factor steps uphill
    assert float(state["norm.scale"].rule.rules[1].f) == -1.0 and float(state["layers.0.w"].rule.rules[1].f) == 0.5
    with pytest.raises(ValueError, match="Scale: f must be a number and finite, got inf"):
        optim.Scale(float("inf"))


def test_by_path_entries_stay_separate_rules_so_adjusting_one_never_splits():
    model = {"a": jnp.ones(2), "b": jnp.ones(2), "c": jnp.ones(2)}
    shared = optim.Adam(0.1)
    state = optim.setup(optim.by_path({"a": optim.Adam(0.1), "b": optim.Adam(0.1), "c": shared}), model)
    assert len(state.rules) == 3
    assert len(optim.setup(optim.by_path({"a": shared, "*": shared}), model).rules) == 1   # one object: one rule
    adjusted = optim.adjust(state, "b", lr=0.5)
    assert adjusted.layout is state.layout       # data only: no split, so no new program
    assert float(adjusted["b"].rule.lr) == 0.5 and float(adjusted["a"].rule.lr) == pytest.approx(0.1)


def test_by_path_exact_path_means_that_path_only():
    """As in freeze: a pattern that is a path of the model selects that leaf, not the glob it also reads as."""
    model = {"w[0]": jnp.ones(2), "w0": jnp.ones(2)}
    state = optim.setup(optim.by_path({"w[0]": optim.Adam(), "*": optim.Descent()}), model)
    assert type(state["w[0]"].rule) is optim.Adam and type(state["w0"].rule) is optim.Descent
    frozen = optim.freeze(optim.setup(optim.Adam(), model), "w[0]")
    assert frozen["w[0]"].frozen and not frozen["w0"].frozen


def test_by_path_refuses_a_pattern_that_matches_no_trainable_leaf():
    """As adjust and freeze refuse such a pattern: a typo would otherwise give its rule to nothing, silently.
    The message suggests the pattern meant; a pattern matching only non-trainable leaves says so."""
    model = {**_mlp(), "step": 3}
    with pytest.raises(ValueError, match=r"by_path: the pattern '\*\.bais' matches no trainable leaf of the model; "
                                         r"did you mean '\*\.bias'\? Fix the pattern"):
        optim.setup(optim.by_path({"*.bais": optim.Adam(), "*": optim.AdamW()}), model)
    with pytest.raises(ValueError, match=r"the pattern 'step' matches no trainable leaf of the model \(it matches "
                                         r"only 'step', which is not trainable"):
        optim.setup(optim.by_path({"step": optim.Adam(), "*": optim.AdamW()}), model)
    with pytest.raises(ValueError, match=r"the pattern 'zzz' matches no trainable leaf of the model \(paths look "
                                         r"like 'layers\.0\.bias', 'layers\.0\.w', 'layers\.1\.bias'\)"):
        optim.setup(optim.by_path({"zzz": optim.Adam(), "*": optim.AdamW()}), model)
    # a default that every leaf reaches through an earlier pattern matches leaves: fine
    state = optim.setup(optim.by_path({"layers": optim.Adam(), "norm": optim.Lion(), "*": optim.AdamW()}), model)
    assert [type(leaf.rule).__name__ for _, leaf in state.items()] == ["Adam"] * 4 + ["Lion"]


# ------------------------------------------------------------------------ setup(..., state_sharding=fn)
# The multi-device behaviour (ZeRO-1 on 8 simulated devices, stacks, collectives) is in test_zero1.py; these
# run on the test process's one device.
def _mesh1():
    return jax.make_mesh((1,), ("data",))


def test_state_sharding_fn_is_called_once_per_parameter_with_its_canonical_path():
    calls = []

    def fn(path, x):
        calls.append((path, tuple(x.shape)))
        return None

    plain = optim.setup(optim.Adam(1e-3), model())
    state = optim.setup(optim.Adam(1e-3), model(), state_sharding=fn)
    assert calls == [("emb", (2, 3)), ("layers.0.b", (1,)), ("layers.0.w", (3,))]   # not 'head' (tied to emb)
    assert state.layout == plain.layout          # None everywhere: as without state_sharding


def test_state_sharding_errors_name_the_path_before_any_state_is_made():
    inits = []

    class Counting(optim.Descent):
        def init(self, x):
            inits.append(x.shape)
            return super().init(x)

    mesh = _mesh1()
    P = jax.sharding.PartitionSpec
    with pytest.raises(TypeError, match="state_sharding= takes a function"):
        optim.setup(Counting(), model(), state_sharding=jax.sharding.NamedSharding(mesh, P()))
    with pytest.raises(TypeError, match=r"state_sharding returned .*'data'.* for 'layers.0.w' \(a PartitionSpec"):
        optim.setup(Counting(), model(), state_sharding=lambda p, x: P("data") if p == "layers.0.w" else None)
    # a spec longer than the parameter's rank (divisibility: test_zero1, which has 8 devices)
    with pytest.raises(ValueError, match=r"state_sharding gives 'layers.0.b' \(float32\[1\]\) the sharding .* cannot "
                                         r"shard that shape.*rank"):
        optim.setup(Counting(), model(), state_sharding=lambda p, x: jax.sharding.NamedSharding(mesh, P(None, "data")))
    with pytest.raises(TypeError, match=r"state_sharding returned 3 for 'emb'; it must return a jax.sharding"):
        optim.setup(Counting(), model(), state_sharding=lambda p, x: 3)
    assert inits == []


def test_state_sharding_places_state_and_update_keeps_it_on_one_device_mesh():
    mesh = _mesh1()
    P = jax.sharding.PartitionSpec
    rep = jax.sharding.NamedSharding(mesh, P())
    w = jax.device_put(jnp.arange(8.0).reshape(4, 2), rep)
    m = {"emb": w, "head": w, "b": jax.device_put(jnp.zeros(2), rep)}
    want = jax.sharding.NamedSharding(mesh, P("data"))
    state = optim.setup(optim.Adam(0.1), m, state_sharding=lambda p, x: want if x.ndim == 2 else None)
    mu, nu, beta = state["emb"].state
    assert mu.sharding.is_equivalent_to(want, 2) and nu.sharding.is_equivalent_to(want, 2)
    assert beta.sharding.is_fully_replicated and beta.sharding.mesh == mesh
    assert state.layout != optim.setup(optim.Adam(0.1), m).layout       # never shares a compiled program
    g = {"emb": jnp.ones((4, 2)), "head": jnp.ones((4, 2)), "b": jnp.ones(2)}
    s1, m1 = optim.update(state, m, g)
    s2, m2 = jax.jit(optim.update)(s1, m1, g)
    for s in (s1, s2):
        assert s["emb"].state[0].sharding.is_equivalent_to(want, 2)
    assert m1["emb"] is m1["head"] and m2["emb"].sharding.is_fully_replicated
    ref_s, ref_m = optim.update(*optim.update(optim.setup(optim.Adam(0.1), {"emb": w, "head": w, "b": jnp.zeros(2)}),
                                              m, g), g)
    np.testing.assert_allclose(m2["emb"], ref_m["emb"], rtol=1e-6)
