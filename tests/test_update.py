"""update: semantics (Optimisers.jl F1, F3, F5, F10), None vs zero, tie_grads / return_grads, bad input,
jit / vmap / pmap, donation. (Freezing is in test_adjust.py, `state[...]` in test_state.py, `donatable` in
test_surgery.py.)"""

import collections
import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from conftest import arr, close


def test_update_leaves_its_inputs_alone():
    """Optimisers.jl F1: Descent(.1) and Momentum(.1) steps; the input model and state are not modified."""
    m = (arr(1, 2),)
    g = (arr(25, 33),)
    state = optim.setup(optim.Descent(0.1), m)
    _, new = optim.update(state, m, g)
    close(new[0], [-1.5, -1.3])
    close(m[0], [1, 2])
    state = optim.setup(optim.Momentum(0.1), m)
    new_state, _ = optim.update(state, m, g)
    close(new_state["0"].state, [2.5, 3.3])
    close(state["0"].state, [0, 0])


def test_dict_models_with_non_array_leaves():
    """Optimisers.jl F3: AdamW(.1) on dicts; an int leaf gets no state and is carried through; int dict keys."""
    m = {"a": arr(1, 2), "b": arr(3, 4), "c": 1}
    state = optim.setup(optim.AdamW(0.1), m)
    assert "c" not in state and len(state) == 2
    g = jax.grad(lambda m: jnp.sum(m["a"] ** 2), allow_int=True)(m)
    _, new = optim.update(state, m, g)
    close(new["a"], [.9, 1.9])
    close(new["b"], [3, 4])
    assert new["c"] == 1
    C = collections.namedtuple("C", "c")
    m = {2: {"a": C(arr(3, 4))}}
    state = optim.setup(optim.AdamW(0.1), m)
    assert state.paths() == ["2.a.c"]
    _, new = optim.update(state, m, jax.grad(lambda m: jnp.sum(m[2]["a"].c))(m))
    close(new[2]["a"].c, [2.9, 3.9])


def test_deeply_nested_model_with_missing_branches_and_scalars():
    """Optimisers.jl F5: None gradients for whole branches and for non-trainable leaves at any depth."""
    m = {"a": [arr(1, 2), 3, "s", None, (arr(5.0), np.int32(4))], "b": {"c": {"d": jnp.zeros(3, jnp.int32)}}}
    state = optim.setup(optim.Momentum(0.1, 0.9), m)
    assert state.paths() == ["a.0", "a.4.0"]
    g = {"a": [arr(1, 1), None, None, None, (None, None)], "b": None}
    _, new = optim.update(state, m, g)
    close(new["a"][0], [.9, 1.9])
    assert new["a"][4][0] is m["a"][4][0]
    assert new["b"]["c"]["d"] is m["b"]["c"]["d"] and new["a"][1:4] == [3, "s", None]


def test_update_without_a_gradient_is_an_error():
    """Optimisers.jl F10 ('forgotten gradient'): `update(state, model)` is an error, a TypeError naming the
    missing `grads`, eagerly and under jit. Only an explicit `None` means no gradient: no step, not an error."""
    x = arr(1, 2)
    state = optim.setup(optim.Descent(), x)
    forgotten = r"update\(\) missing 1 required positional argument: 'grads'"
    for step in (optim.update, jax.jit(optim.update)):
        with pytest.raises(TypeError, match=forgotten):
            step(state, x)
    m = {"x": x, "y": jnp.sin}
    state = optim.setup(optim.Descent(), m)
    with pytest.raises(TypeError, match=forgotten):
        optim.update(state, m)
    _, new = optim.update(state, m, None)          # "no gradient" said explicitly: no step, no error
    assert new["x"] is x and new["y"] is jnp.sin


def test_none_vs_zero_gradient():
    m = {"x": arr(1.0)}
    state = optim.setup(optim.Adam(0.1), m)
    zs, zm = optim.update(state, m, {"x": arr(0.0)})
    ns, nm = optim.update(state, m, {"x": None})
    assert not np.allclose(zs["x"].state[2][0], state["x"].state[2][0])   # bt advanced
    assert same_arrays(ns, state) and nm["x"] is m["x"]                  # nothing copied or recomputed
    ns, nm = optim.update(state, m, None)                                  # None for the whole tree
    assert nm["x"] is m["x"] and same_arrays(ns, state)


def same_arrays(a, b):
    """The same optimiser-state array objects (the step counter aside)."""
    return all(x is y for x, y in zip(jax.tree.leaves((a.stored, a.packs)), jax.tree.leaves((b.stored, b.packs)),
                                      strict=True))


def test_tie_grads_and_return_grads():
    w = jnp.array([1.0, 2.0])
    m = {"a": w, "b": w, "c": jnp.ones(1), "n": 3}
    state = optim.setup(optim.Descent(0.1), m)
    g = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, 4.0]), "c": None, "n": None}
    tg = optim.tie_grads(state, g)
    close(tg["a"], [4.0, 6.0])
    assert tg["b"] is None and tg["c"] is None and tg["n"] is None
    assert float(optax.global_norm(tg)) == pytest.approx(np.sqrt(52.0))
    s1, m1, rg = optim.update(state, m, g, return_grads=True)
    close(rg["a"], [4.0, 6.0])
    # an already-summed gradient at the canonical path gives the same step (Optimisers.jl #193)
    _, m2 = optim.update(state, m, tg)
    close(m2["b"], m1["b"])
    s3, m3, rg3 = jax.jit(lambda s, m, g: optim.update(s, m, g, return_grads=True))(state, m, g)
    close(rg3["a"], [4.0, 6.0])


# ----------------------------------------------------------------------------------------- bad input
def _model():
    return {"w": arr(1, 2), "b": arr(0.5), "n": 3}


@pytest.mark.parametrize("grads, exc, match", [
    ({"w": arr(1, 1), "b": arr(1.0)}, ValueError, "no entry for 'n'"),
    ({"w": arr(1, 1), "b": arr(1.0), "n": None, "z": arr(1.0)}, ValueError, "'z', which is not a path"),
    ({"w": arr(1, 1, 1), "b": arr(1.0), "n": None}, ValueError, "gradient at 'w' has shape"),
    ({"w": jnp.array([1, 1]), "b": arr(1.0), "n": None}, TypeError, "gradient at 'w' has dtype int32"),
    ({"w": arr(1, 1), "b": jnp.array([1j], jnp.complex64), "n": None}, TypeError, "'b' is complex"),
    ([arr(1, 1), arr(1.0), None], ValueError, "has a leaf"),
])
def test_bad_gradients_raise_before_anything_runs(grads, exc, match):
    m = _model()
    state = optim.setup(optim.Momentum(0.1), m)
    before = copy.deepcopy(jax.tree.map(np.asarray, (state.stacks, m)))
    with pytest.raises(exc, match=match):
        optim.update(state, m, grads)
    with pytest.raises(exc, match=match):
        jax.jit(optim.update)(state, m, grads)
    after = jax.tree.map(np.asarray, (state.stacks, m))
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_gradient_leaf_where_model_has_subtree():
    m = {"a": {"x": arr(1.0)}}
    state = optim.setup(optim.Descent(), m)
    with pytest.raises(ValueError, match="at 'a', where the model has a subtree"):
        optim.update(state, m, {"a": arr(1.0)})


def test_state_for_a_different_model():
    state = optim.setup(optim.Descent(), _model())
    with pytest.raises(ValueError, match="missing 'b'"):
        optim.update(state, {"w": arr(1, 2), "n": 3}, {"w": arr(1, 1), "n": None})
    other = {"w": arr(1, 2, 3), "b": arr(0.5), "n": 3}
    with pytest.raises(ValueError, match="model leaf 'w' is float32\\[3\\].*float32\\[2\\]"):
        optim.update(state, other, {"w": arr(1, 1, 1), "b": arr(1.0), "n": None})
    with pytest.raises(TypeError, match="expected the State"):
        optim.update(_model(), _model(), _model())


def test_tied_member_shape_is_checked_too():
    w = arr(1, 2)
    state = optim.setup(optim.Descent(), {"a": w, "b": w})
    with pytest.raises(ValueError, match="model leaf 'b'"):
        optim.update(state, {"a": w, "b": arr(1, 2, 3)}, {"a": arr(1, 1), "b": None})


def test_non_rule_and_duplicate_paths():
    with pytest.raises(TypeError, match="not a rule"):
        optim.setup("adam", _model())
    # Paths are only needed to name leaves: the clash is reported where a path is used.
    state = optim.setup(optim.Descent(), {"a.b": arr(1.0), "a": {"b": arr(1.0)}})
    for use in (lambda: state["a.b"], lambda: optim.freeze(state, "a"),
                lambda: optim.setup(optim.Descent(), {"a.b": arr(1.0), "a": {"b": arr(1.0)}}, ties={"a.b": "a.b"})):
        with pytest.raises(ValueError, match="'a.b'.* several leaves"):
            use()


def test_setup_warns_on_no_trainable_leaves():
    with pytest.warns(UserWarning, match="no trainable leaves"):
        optim.setup(optim.Adam(), {"n": 1, "i": jnp.arange(3)})


# ----------------------------------------------------------------------------------------- transforms
def test_adjust_and_fresh_setup_never_retrace():
    traces = []

    @jax.jit
    def step(state, m, x):
        traces.append(1)
        g = jax.grad(lambda m: jnp.sum((m["w"] * x) ** 2), allow_int=True)(m)   # float0 for "n"
        return optim.update(state, m, g)

    m = {"w": arr(1, 2), "n": 1}
    state = optim.setup(optim.OptimiserChain(optim.ClipNorm(1.0), optim.Adam(1e-2)), m)
    x = arr(1.0, 1.0)
    state, m2 = step(state, m, x)
    state = optim.adjust(state, lr=1e-4, max_norm=2.0, beta=(0.8, 0.9))
    state, m2 = step(state, m2, x)
    state, m2 = step(optim.setup(optim.OptimiserChain(optim.ClipNorm(1.0), optim.Adam(1e-2)), m), m2, x)
    assert len(traces) == 1
    # and the adjusted value is used
    s = optim.adjust(optim.setup(optim.Descent(1.0), {"w": arr(1.0), "n": 1}), 0.5)
    _, out = step(s, {"w": arr(1.0), "n": 1}, arr(1.0))
    close(out["w"], [0.0])


def test_eager_equals_jit_and_eager_compiles_once_per_structure():
    m = {"a": arr(1, 2), "b": [arr(3.0), 4]}
    g = {"a": arr(0.1, 0.2), "b": [arr(0.3), None]}
    s1, m1 = optim.update(optim.setup(optim.Adam(0.1), m), m, g)
    s2, m2 = jax.jit(optim.update)(optim.setup(optim.Adam(0.1), m), m, g)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), (s1, m1), (s2, m2))
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *a, **k: compiles.append(event) if event.endswith("backend_compile_duration") else None)
    for _ in range(3):
        s1, m1 = optim.update(s1, m1, g)
    optim.update(optim.setup(optim.Adam(0.1), m), m, g)     # a fresh, equal state: no new compile
    assert compiles == []
    optim.update(s1, {"a": m["a"], "b": [m["b"][0], 5]}, g)  # another int value: not part of the program
    assert compiles == []
    optim.update(s1, m1, {"a": None, "b": [m["b"][0], None]})  # another None pattern: one new program
    assert len(compiles) == 1


def test_vmap_over_independent_models():
    ms = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])}
    gs = {"w": jnp.array([[1.0, 1.0], [2.0, -1.0]])}
    state = optim.setup(optim.Adam(0.1), {"w": ms["w"][0]})
    states = jax.tree.map(lambda x: jnp.stack([x, x]), state)
    new_states, new_ms = jax.vmap(optim.update)(states, ms, gs)
    for i in range(2):
        s, mi = optim.update(state, {"w": ms["w"][i]}, {"w": gs["w"][i]})
        close(new_ms["w"][i], mi["w"])
        close(new_states["w"].state[0][i], s["w"].state[0])


def test_pmap_single_device_with_ties():
    w = arr(1, 2)
    m = {"a": w, "b": w}
    state = optim.setup(optim.Momentum(0.1), m)
    rep = lambda t: jax.tree.map(lambda x: jnp.stack([x]), t)
    g = {"a": arr(1, 1), "b": arr(1, 0)}
    s, out = jax.pmap(optim.update)(rep(state), rep(m), rep(g))
    close(out["a"][0], [0.8, 1.9])
    close(out["b"][0], out["a"][0])


def test_donate_reuses_buffers_only_when_asked():
    m = {"w": jnp.ones(1000), "v": jnp.ones(1000)}
    state = optim.setup(optim.Momentum(0.1), m)
    g = {"w": jnp.ones(1000), "v": jnp.ones(1000)}
    s1, m1 = optim.update(state, m, g)
    s1b, _ = optim.update(s1, m1, g)
    assert not m["w"].is_deleted() and not m1["w"].is_deleted() and not s1.stacks[0].is_deleted()
    s2, m2 = optim.update(s1, m1, g, donate=True)
    close(m2["w"][:2], [1 - 0.1 - 0.19] * 2)
    assert m1["w"].is_deleted() and s1.stacks[0].is_deleted()


def test_donate_with_ties_donates_each_buffer_once():
    w = jnp.ones(100)
    m = {"a": w, "b": w}
    state = optim.setup(optim.Descent(0.1), m)
    _, out = optim.update(state, m, {"a": jnp.ones(100), "b": jnp.ones(100)}, donate=True)
    close(out["a"][:1], [0.8])
    assert out["a"] is out["b"]


def test_equinox_module_with_filter_grad():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.PRNGKey(0))
    state = optim.setup(optim.Adam(1e-2), model)
    x = jnp.ones((8, 2))
    loss = lambda m: jnp.mean(jax.vmap(m)(x) ** 2)
    l0 = loss(model)
    for _ in range(5):
        state, model = optim.update(state, model, eqx.filter_grad(loss)(model))
    assert loss(model) < l0
    assert isinstance(model, eqx.nn.MLP)


def test_donating_a_fresh_state_works_eagerly_and_in_a_user_jit():
    m = {"w": jnp.ones(3), "v": jnp.ones(3)}
    g = {"w": jnp.ones(3), "v": jnp.ones(3)}
    for rule in (optim.Adam(0.1), optim.AMSGrad(0.1), optim.chain(optim.ClipNorm(1.0), optim.RAdam(0.1))):
        optim.update(optim.setup(rule, m), jax.tree.map(jnp.copy, m), g, donate=True)
        step = jax.jit(optim.update, donate_argnums=(0, 1))
        s, out = step(optim.setup(rule, m), jax.tree.map(jnp.copy, m), g)
        s, out = step(s, out, g)
        ref_state, ref = optim.update(optim.setup(rule, m), m, g)
        _, ref = optim.update(ref_state, ref, g)              # the same two steps, without donation
        close(out["w"], ref["w"])
        close(out["v"], ref["v"])


# ----------------------------------------------------------------------------------------- hardening
def test_numpy_float64_model_under_32_bit_jax():
    """setup records the dtype JAX will use: float64 numpy arrays become float32 unless x64 is on."""
    assert not jax.config.jax_enable_x64
    model = {"w": np.array([1.0, 2.0]), "b": np.zeros(3)}
    state = optim.setup(optim.Adam(0.1), model)
    assert state["w"].state[0].dtype == jnp.float32
    state, new = optim.update(state, model, {"w": np.ones(2), "b": np.ones(3)})
    np.testing.assert_allclose(new["w"], [0.9, 1.9], rtol=1e-6)
    assert new["w"].dtype == jnp.float32
    state, new = optim.update(state, new, {"w": np.ones(2), "b": np.ones(3)})   # then float32 arrays
    state, new = optim.update(state, model, {"w": np.ones(2), "b": np.ones(3)})  # and numpy again
    assert np.isfinite(new["w"]).all()


def test_gradients_matched_by_key_path_not_dotted_name():
    model = {"a": {"b": arr(1.0)}}
    state = optim.setup(optim.Descent(), model)
    with pytest.raises(ValueError, match=r"at 'a.b', which is not a path of the model \(key path \['a.b'\]"):
        optim.update(state, model, {"a.b": arr(1.0)})


def test_model_with_colliding_dotted_names_trains():
    """Dotted names are for people: two leaves may share one and the model still trains, each with its own
    gradient (matched by key path)."""
    model = {"a.b": arr(1.0), "a": {"b": arr(10.0)}}
    state = optim.setup(optim.Descent(1.0), model)
    state, new = optim.update(state, model, {"a.b": arr(0.5), "a": {"b": arr(2.0)}})
    np.testing.assert_allclose(new["a.b"], [0.5])
    np.testing.assert_allclose(new["a"]["b"], [8.0])
    state, new = optim.update(state, new, {"a.b": None, "a": {"b": arr(1.0)}})
    np.testing.assert_allclose(new["a.b"], [0.5])
    np.testing.assert_allclose(new["a"]["b"], [7.0])
    assert len(state) == 2


@pytest.mark.parametrize("ties, match", [
    ([("head", "emb")], r"ties= takes a dict \{path: canonical_path\}.*write ties=dict\(pairs\)"),
    ({0: "emb"}, "ties= keys are dotted paths \\(str\\), got int 0"),
    ({"head": 3}, r"ties\['head'\] must be a canonical path \(str\) or \(path, function\), got 3"),
    ("head=emb", "ties= takes a dict"),
])
def test_ties_of_the_wrong_form_are_refused(ties, match):
    model = {"emb": arr(1.0), "head": arr(1.0)}
    with pytest.raises(TypeError, match=match):
        optim.setup(optim.Descent(), model, ties=ties)


@pytest.mark.parametrize("bad", ["oops", object()], ids=["str", "object"])
def test_gradient_leaf_that_is_not_an_array_names_the_model_path(bad):
    model = {"enc": {"w": arr(1.0, 2.0)}, "head": [arr(3.0)]}
    state = optim.setup(optim.Adam(), model)
    with pytest.raises(TypeError, match=r"update: grads has (str|object) .* at 'head.0', where the model has a param"):
        optim.update(state, model, {"enc": {"w": arr(1.0, 1.0)}, "head": [bad]})
    with pytest.raises(TypeError, match=r"tie_grads: grads has .* at 'enc.w'"):
        optim.tie_grads(state, {"enc": {"w": bad}, "head": [arr(1.0)]})
    with pytest.raises(TypeError, match=r"model leaf 'enc.w' is str"):
        optim.update(state, {"enc": {"w": "oops"}, "head": [arr(3.0)]}, {"enc": {"w": arr(1.0, 1.0)}, "head": None})


def test_gradient_leaf_that_is_not_an_array_under_jit():
    model = {"w": arr(1.0)}
    state = optim.setup(optim.Descent(), model)
    with pytest.raises(TypeError, match="at 'w', where the model has a parameter"):
        jax.jit(lambda s, m: optim.update(s, m, {"w": "oops"}), static_argnums=())(state, model)


# ----------------------------------------------------------------------------------------------- return_stats
def _stats_model():
    w = jnp.array([1.0, -2.0, 2.0])
    return {"emb": w, "head": w, "b": jnp.array([0.5, 0.5]), "frozen": jnp.array([3.0, 4.0]),
            "idle": jnp.array([[1.0, 2.0], [2.0, 4.0]]), "n": 7}


def _stats_grads():
    return {"emb": jnp.array([1.0, 0.0, 2.0]), "head": jnp.array([0.5, 1.0, -1.0]), "b": jnp.array([3.0, -4.0]),
            "frozen": jnp.array([1.0, 1.0]), "idle": None, "n": None}


def _reference_stats(old, new, grads):
    """numpy: each parameter once; the tie's gradients summed; no-step parameters have gradient and update 0."""
    g = {"emb": np.asarray(grads["emb"]) + np.asarray(grads["head"]), "b": np.asarray(grads["b"]),
         "frozen": np.zeros(2), "idle": np.zeros((2, 2))}
    per = {p: {"grad_norm": np.linalg.norm(g[p]), "update_norm": np.linalg.norm(np.asarray(old[p]) - new[p]),
               "param_norm": np.linalg.norm(new[p])} for p in g}
    total = {k: np.sqrt(sum(v[k] ** 2 for v in per.values())) for k in ("grad_norm", "update_norm", "param_norm")}
    return total, per


@pytest.mark.parametrize("jit", [False, True])
def test_return_stats_counts_each_parameter_once(jit):
    model = _stats_model()
    state = optim.freeze(optim.setup(optim.Adam(0.1), model), "frozen")
    state, model = optim.update(state, model, _stats_grads())     # Adam steps differ from the gradients
    run = jax.jit(optim.update, static_argnames="return_stats") if jit else optim.update
    new_state, new_model, stats = run(state, model, _stats_grads(), return_stats=True)
    total, per = _reference_stats(model, {k: np.asarray(v) for k, v in new_model.items() if k != "n"},
                                  _stats_grads())
    for k, v in total.items():
        np.testing.assert_allclose(stats[k], v, rtol=1e-6)
    assert set(stats["per_param"]) == {"emb", "b", "frozen", "idle"}
    for p, d in per.items():
        for k, v in d.items():
            np.testing.assert_allclose(stats["per_param"][p][k], v, rtol=1e-6, atol=1e-7, err_msg=f"{p} {k}")
    assert stats["update_norm"] > 0 and float(stats["per_param"]["frozen"]["update_norm"]) == 0.0
    # The step itself is the one without stats.
    _, plain = optim.update(state, model, _stats_grads())
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), new_model, plain)


def test_return_stats_with_return_grads_and_stacked_parameters():
    """Many small same-shape parameters share a stack: per-parameter norms come out per row, in path order."""
    model = {f"p{i}": jnp.full(3, float(i)) for i in range(70)}
    grads = {f"p{i}": jnp.array([1.0, -1.0, 0.5]) * (i + 1) for i in range(70)}
    state = optim.setup(optim.Descent(0.1), model)
    state, new, summed, stats = optim.update(state, model, grads, return_grads=True, return_stats=True)
    assert summed["p3"] is not None
    for p in model:
        np.testing.assert_allclose(stats["per_param"][p]["grad_norm"], np.linalg.norm(grads[p]), rtol=1e-6)
        np.testing.assert_allclose(stats["per_param"][p]["update_norm"], 0.1 * np.linalg.norm(grads[p]), rtol=1e-5)
        np.testing.assert_allclose(stats["per_param"][p]["param_norm"], np.linalg.norm(new[p]), rtol=1e-6)
    np.testing.assert_allclose(stats["grad_norm"], optim.global_norm(grads, state), rtol=1e-6)


def test_return_stats_low_precision_complex_and_mixed_precision():
    """Norms accumulate in float32 for bfloat16 parameters; complex parameters use |z|²; a Replace step
    (MixedPrecision) reports the update actually applied to the bfloat16 parameter."""
    x = jnp.full((4096,), 1.0, jnp.bfloat16)
    z = jnp.array([1 + 1j, 2 - 1j], jnp.complex64)
    model = {"x": x, "z": z}
    state = optim.setup(optim.MixedPrecision(optim.Descent(1e-3)), model)
    grads = {"x": jnp.ones(4096, jnp.bfloat16), "z": jnp.array([1j, 1.0], jnp.complex64)}
    _, new, stats = optim.update(state, model, grads, return_stats=True)
    np.testing.assert_allclose(stats["per_param"]["x"]["grad_norm"], 64.0, rtol=1e-6)   # sqrt(4096)
    applied = np.asarray(x, np.float32) - np.asarray(new["x"], np.float32)
    np.testing.assert_allclose(stats["per_param"]["x"]["update_norm"], np.linalg.norm(applied), rtol=1e-6)
    np.testing.assert_allclose(stats["per_param"]["z"]["grad_norm"], np.sqrt(2.0), rtol=1e-6)
    np.testing.assert_allclose(stats["per_param"]["z"]["param_norm"], np.linalg.norm(np.asarray(new["z"])),
                               rtol=1e-6)
    assert stats["grad_norm"].dtype == jnp.float32


@pytest.mark.parametrize("dtype, bits", [(jnp.bfloat16, (8, 7)), (jnp.float16, (5, 10))])
def test_rounding_of_a_low_precision_parameter_is_forced_where_the_step_reads_it_back(dtype, bits, monkeypatch):
    """The update norm and an EMA's average read the new parameter as stored: XLA allows excess precision and may
    drop a float32 -> bfloat16 -> float32 round trip inside a fusion (XLA:GPU did: `update_norm` 0.064 for a
    step that rounded away), so the program rounds explicitly (`reduce_precision` to the parameter's format, in
    float32), which XLA keeps. Checked in the lowered program and, on XLA's path, in the compiled one."""
    import re
    from optim._engine import fused as _fused
    monkeypatch.setattr(_fused, "ENABLED", False)
    x = {"w": jnp.ones((64,), dtype)}
    g = {"w": jnp.ones((64,), dtype)}
    want = [f"reduce_precision %\\S+, format = e{bits[0]}m{bits[1]}",              # StableHLO
            f"reduce-precision\\(\\S+\\), exponent_bits={bits[0]}, mantissa_bits={bits[1]}"]   # compiled HLO
    for rule, stats in [(optim.MixedPrecision(optim.Descent(1e-3)), True), (optim.EMA(optim.Descent(1e-3)), False)]:
        state = optim.setup(rule, x)
        lowered = jax.jit(lambda s, m, d: optim.update(s, m, d, return_stats=stats)).lower(state, x, g)
        for pattern, text in zip(want, (lowered.as_text(), lowered.compile().as_text())):
            assert re.search(pattern, text), (rule, pattern)
    # a step below the parameter's resolution (half an ulp of 1 is 2⁻⁹ in bfloat16, 2⁻¹¹ in float16)
    _, new, st = optim.update(optim.setup(optim.MixedPrecision(optim.Descent(1e-4)), x), x, g, return_stats=True)
    assert np.array_equal(np.asarray(new["w"]), np.asarray(x["w"])) and float(st["update_norm"]) == 0.0


def test_return_stats_adds_reductions_not_a_second_pass_over_the_gradients(monkeypatch):
    """The compiled step with stats has the same kernels as without, plus a few reductions per stack: count
    the fusions of each compiled program (a structural check, not a timing). XLA's path: with optim's fused CPU
    kernel the 4 parameters would be one stack (tests/test_fused.py)."""
    import re
    from optim._engine import fused as _fused
    monkeypatch.setattr(_fused, "ENABLED", False)
    model = {f"p{i}": jnp.ones(16384) * i for i in range(4)}
    grads = jax.tree.map(jnp.ones_like, model)
    state = optim.setup(optim.Adam(1e-3), model)

    def step(s, m, g, rs):
        if not rs:
            return optim.update(s, m, g)
        s, m, stats = optim.update(s, m, g, return_stats=True)
        return s, m, stats["grad_norm"], stats["update_norm"], stats["param_norm"]

    def fusions(rs):
        text = jax.jit(step, static_argnums=3).lower(state, model, grads, rs).compile().as_text()
        return len(re.findall(r"^\s*\S+ = \S+ fusion\(", text[text.index("ENTRY"):], re.M))

    plain, with_stats = fusions(False), fusions(True)
    # Each of the 4 parameters: 3 reductions (gradient, old - new, new), then a little assembly that does not
    # grow with the parameters' size (8 measured: the per-parameter table, the totals, their slices).
    assert plain + 4 * 3 < with_stats <= plain + 4 * 3 + 10, (plain, with_stats)


def test_a_parameter_passed_as_its_own_gradient_with_donation():
    """`donate=True` gives the parameters' buffers away; a gradient that is the same array cannot be read then.
    The error names the path, and nothing was given away or changed: the same call without donation works."""
    m = {"a": jnp.ones(4), "b": jnp.ones(3)}
    state = optim.setup(optim.Adam(0.1), m)
    with pytest.raises(ValueError, match=r"gradient at 'a' is the array of the parameter at 'a'.*donate=False"):
        optim.update(state, m, {"a": m["a"], "b": jnp.ones(3)}, donate=True)
    np.testing.assert_array_equal(m["a"], jnp.ones(4))
    _, new = optim.update(state, m, {"a": m["a"], "b": jnp.ones(3)})
    np.testing.assert_allclose(new["a"], 0.9)


@pytest.mark.parametrize("rule", [
    optim.Adam(1e-3), optim.ScheduleFreeAdamW(1e-3), optim.EMA(optim.AdamW(1e-3)),
    optim.MixedPrecision(jnp.float32, optim.Adam(1e-3)),
    optim.SkipNonFinite(optim.EMA(optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(1e-3)))),
], ids=["Adam", "ScheduleFreeAdamW", "EMA", "MixedPrecision", "production stack"])
@pytest.mark.parametrize("donate", [False, True], ids=["", "donated"])
def test_a_jitted_step_compiles_once_from_a_fresh_state(rule, donate, caplog):
    # Rules whose init reads the parameter (EMA's copy, Schedule-Free's z) made their state committed to the
    # device while jnp's model is not; the step's outputs were then all committed and the second call compiled
    # again (a whole train step, twice).
    model = {"w": jnp.ones((16, 8)), "b": jnp.ones((8,))}
    grads = jax.tree.map(lambda a: 0.1 * a, model)
    state = optim.setup(rule, model)
    step = jax.jit(optim.update, donate_argnums=(0, 1) if donate else ())
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        for _ in range(3):
            state, model = step(state, model, grads)
    compiles = [r for r in caplog.records if "Finished XLA compilation of jit(update)" in r.getMessage()]
    assert len(compiles) == 1, [r.getMessage() for r in compiles]
