"""adjust (Optimisers.jl F7): hyperparameters change as data, through chains and MixedPrecision; freeze and thaw
(Optimisers.jl F8): frozen flags by path or pattern, tie groups frozen together."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optim
from conftest import arr, close, counted_update
from optim._engine import fused as _fused


def hyper(x):
    return float(np.asarray(x))


def test_adjust_lr_keeps_state_and_other_fields():
    """Optimisers.jl F7: adjust(.2) sets lr only and keeps the state; adjust(lr=.3, rho=.7) sets both; the input
    state is not modified."""
    m = {"g": jnp.ones((4, 3, 2), jnp.float32)}
    state = optim.setup(optim.Momentum(0.1, 0.9), m)
    s2 = optim.adjust(state, 0.2)
    assert hyper(s2.rule.lr) == pytest.approx(0.2) and hyper(s2.rule.rho) == pytest.approx(0.9)
    assert s2.stacks is state.stacks
    s3 = optim.adjust(state, lr=0.3, rho=0.7)
    assert hyper(s3.rule.lr) == pytest.approx(0.3) and hyper(s3.rule.rho) == pytest.approx(0.7)
    assert hyper(state.rule.lr) == pytest.approx(0.1)           # the input is not modified


def test_adjust_reaches_into_chains_and_mixed_precision():
    rule = optim.MixedPrecision(jnp.float32, optim.OptimiserChain(optim.ClipGrad(2.0), optim.Adam(1e-3)))
    state = optim.setup(rule, {"w": jnp.ones(3, jnp.float16)})
    s = optim.adjust(state, 0.2)
    inner = s.rule.rule.rules
    assert hyper(inner[1].lr) == pytest.approx(0.2) and hyper(inner[0].delta) == 2.0
    s = optim.adjust(state, delta=2.5)
    assert hyper(s.rule.rule.rules[0].delta) == 2.5 and hyper(s.rule.rule.rules[1].lr) == pytest.approx(1e-3)


def test_adjust_keeps_abstract_types():
    state = optim.setup(optim.Adam(1e-3), {"w": jnp.ones(2)})
    before = jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "weak_type", None)), state.rules)
    after = jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "weak_type", None)),
                         optim.adjust(state, lr=1, beta=[0.5, 0.6], eps=np.float64(1e-5)).rules)
    assert before == after


def test_adjust_bare_rule_and_beta_pair():
    r = optim.adjust(optim.Adam(0.1), beta=(0.8, 0.9))
    assert r.beta == (0.8, 0.9) and r.lr == 0.1


def test_adjust_errors():
    state = optim.setup(optim.OptimiserChain(optim.ClipGrad(2.0), optim.Adam()), {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="no rule here has lrr; adjustable: beta, delta, eps, lr"):
        optim.adjust(state, lrr=0.1)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        optim.adjust(state, -1.0)
    with pytest.raises(TypeError, match="at least one"):
        optim.adjust(state)
    with pytest.raises(ValueError, match="structural"):
        optim.adjust(optim.setup(optim.RMSProp(centred=True), {"w": jnp.ones(2)}), centred=False)
    with pytest.raises(ValueError, match="tuple of 2"):
        optim.adjust(state, beta=0.9)


def test_adjust_inside_jit_with_traced_value():
    m = {"w": jnp.ones(2)}
    state = optim.setup(optim.Descent(1.0), m)

    @jax.jit
    def step(state, m, lr):
        state = optim.adjust(state, lr)
        return optim.update(state, m, {"w": jnp.ones(2)})

    _, out = step(state, m, 0.25)
    np.testing.assert_allclose(out["w"], [0.75, 0.75])


# ----------------------------------------------------------------------------------------- hardening
# A hyperparameter given as an int is a float like any other: adjust never truncates it (eagerly, under jit
# with a traced value, or in a meta-gradient through it).
INT_CASES = [
    ("Descent(1)", lambda: optim.Descent(1), {"lr": 0.5}),
    ("ClipGrad(2)", lambda: optim.chain(optim.ClipGrad(2), optim.Descent(1.0)), {"delta": 0.5}),
    ("ClipNorm(1)", lambda: optim.chain(optim.ClipNorm(1), optim.Descent(1.0)), {"max_norm": 0.5}),
    ("ClipGlobalNorm(1)", lambda: optim.chain(optim.ClipGlobalNorm(1), optim.Descent(1.0)), {"max_norm": 0.5}),
    ("AdamW(wd=0)", lambda: optim.AdamW(1e-3, weight_decay=0), {"weight_decay": 0.1}),
    ("int schedule", lambda: optim.Descent(optim.Linear(1, 0, 10)), {"lr": optim.Linear(0.5, 0.25, 10)}),
]


def _float_reference(make, hyper):
    """The same rule built from the start with the float values."""
    rule = make()
    return optim.adjust(jax.tree.map(lambda v: float(v) if isinstance(v, (int, float)) else v, rule), **hyper)


@pytest.mark.parametrize("name, make, hyper", INT_CASES, ids=[c[0] for c in INT_CASES])
def test_adjust_of_int_hyperparameter_gives_the_float_step(name, make, hyper):
    m = {"w": jnp.array([3.0, -4.0])}
    g = {"w": jnp.array([2.0, 1.0])}
    adjusted = optim.adjust(optim.setup(make(), m), **hyper)
    fresh = optim.setup(_float_reference(make, hyper), m)
    _, got = optim.update(adjusted, m, g)
    _, want = optim.update(fresh, m, g)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)
    assert not np.allclose(got["w"], optim.update(optim.setup(make(), m), m, g)[1]["w"])  # the adjust mattered


def test_adjust_int_hyperparameter_with_traced_value_under_jit():
    m = {"w": jnp.array([1.0, 1.0])}
    state = optim.setup(optim.Descent(1), m)
    step = jax.jit(lambda s, lr: optim.update(optim.adjust(s, lr=lr), m, {"w": jnp.ones(2)})[1])
    np.testing.assert_allclose(step(state, 0.25)["w"], [0.75, 0.75])


def test_meta_gradient_through_int_hyperparameter():
    m = {"w": jnp.array([1.0, 2.0])}
    state = optim.setup(optim.Descent(1), m)

    def loss_after_step(lr):
        _, new = optim.update(optim.adjust(state, lr=lr), m, {"w": jnp.array([1.0, 1.0])})
        return jnp.sum(new["w"] ** 2)

    # d/dlr sum((w - lr)^2) = -2 sum(w - lr) = -2 * (0.5 + 1.5) at lr = 0.5
    assert float(jax.grad(loss_after_step)(0.5)) == pytest.approx(-4.0)


@settings(max_examples=25, deadline=None)
@given(i=st.integers(0, 5), f=st.floats(0.01, 5.0, allow_nan=False, allow_infinity=False))
def test_property_adjust_int_to_float(i, f):
    """For any hyperparameter given as an int, adjust to a float gives the float's step."""
    m = {"w": jnp.array([1.0, -2.0])}
    state = optim.adjust(optim.setup(optim.Descent(i), m), lr=f)
    _, new = optim.update(state, m, {"w": jnp.array([1.0, 1.0])})
    np.testing.assert_allclose(new["w"], np.array([1.0, -2.0], np.float32) - np.float32(f), rtol=1e-6)


@pytest.mark.parametrize("value, err, match", [
    (jnp.asarray(-1.0), ValueError, "Descent: lr must be >= 0 and finite, got -1.0"),
    (jnp.nan, ValueError, "lr must be >= 0 and finite, got nan"),
    (float("inf"), ValueError, "lr must be >= 0 and finite, got inf"),
    ("0.1", TypeError, "lr must be a real number"),
    (None, TypeError, "lr must be a real number"),
])
def test_adjust_validates_like_the_constructor(value, err, match):
    state = optim.setup(optim.Descent(0.1), {"w": jnp.ones(2)})
    with pytest.raises(err, match=match):
        optim.adjust(state, lr=value)


def test_adjust_refuses_an_array_for_a_scalar_hyperparameter():
    """A hyperparameter is one number (or a schedule): an array is a ValueError naming the rule and the
    hyperparameter, not numpy's reshape error, and the state is left as it was."""
    state = optim.setup(optim.Adam(0.1), {"enc": {"w": jnp.ones(2)}, "dec": {"w": jnp.ones(3)}})
    with pytest.raises(ValueError, match=r"Adam: lr must be a scalar, got an array of shape \(2,\): a "
                                         r"hyperparameter is one number .*or an optim schedule"):
        optim.adjust(state, lr=jnp.array([0.1, 0.2]))
    with pytest.raises(ValueError, match=r"Adam: beta\[0\] must be a scalar, got an array of shape \(1,\)"):
        optim.adjust(state, "enc", beta=(np.array([0.5]), 0.9))
    with pytest.raises(ValueError, match=r"Adam: lr must be a scalar"):
        optim.adjust(optim.Adam(0.1), lr=jnp.ones((2, 2)))
    assert float(state["enc.w"].rule.lr) == pytest.approx(0.1) and len(state.rules) == 1


class _Plain(optim.Rule):
    """A user rule whose field the constructor does not check (no range declared)."""

    lr: float = 0.1

    def apply(self, state, x, dx, *dxs):
        return state, self.lr * dx


def test_adjust_refuses_an_array_for_an_unchecked_scalar_field():
    state = optim.setup(_Plain(), {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"adjust: _Plain\.lr is a scalar but the new value is an array of shape "
                                         r"\(2,\): a hyperparameter is one number"):
        optim.adjust(state, lr=jnp.array([0.1, 0.2]))
    with pytest.raises(ValueError, match=r"adjust: _Plain\.lr is a scalar but the new value is an array of shape "
                                         r"\(3,\)"):
        jax.jit(lambda s, v: optim.adjust(s, lr=v))(state, jnp.ones(3))   # traced: its shape is known
    assert float(optim.adjust(state, lr=0.5)["w"].rule.lr) == 0.5


def test_adjust_checks_a_schedule_against_the_hyperparameter_range():
    """As `lr=-0.1` is refused, so is a schedule that goes below 0 (its range follows from its numbers)."""
    state = optim.setup(optim.Adam(0.1), {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"Adam: lr must be >= 0 at every step, but the schedule Cosine\(init=-0.5, "
                                         r"steps=20, final=0\) takes values down to -0.5 \(its range is \[-0.5, 0\]\)"):
        optim.adjust(state, lr=optim.Cosine(-0.5, 20))
    with pytest.raises(ValueError, match=r"Adam: beta\[1\] must be in \[0, 1\) at every step, but the schedule "
                                         r"Linear\(.*\) takes values up to 1"):
        optim.adjust(state, beta=(0.9, optim.Linear(0.99, 1.0, 100)))
    with pytest.raises(ValueError, match=r"Adam: lr must be >= 0 at every step"):
        optim.adjust(state, "w", lr=optim.warmup_cosine(1e-3, 10, 100, final=-1e-4))
    ok = optim.adjust(state, lr=optim.Cosine(0.5, 20), beta=(optim.Linear(0.8, 0.95, 10), 0.999))
    assert isinstance(ok["w"].rule.lr, optim.Cosine)


def test_pattern_that_matches_nothing_suggests_the_one_meant():
    state = optim.setup(optim.Adam(0.1), {"dense": {"w": jnp.ones(2), "bias": jnp.ones(2)}})
    with pytest.raises(ValueError, match=r"adjust: '\*\.bais' matches no trainable path of the model; did you mean "
                                         r"'\*\.bias'\?"):
        optim.adjust(state, "*.bais", lr=0.1)
    with pytest.raises(ValueError, match=r"freeze: 'zzz' matches no trainable path of the model \(paths look like "
                                         r"'dense\.bias', 'dense\.w'\)"):
        optim.freeze(state, "zzz")


def test_adjust_validates_beta_components():
    state = optim.setup(optim.Adam(), {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"Adam: beta\[1\] must be in \[0, 1\)"):
        optim.adjust(state, beta=(0.9, 1.0))
    with pytest.raises(ValueError, match="tuple of 2 values"):
        optim.adjust(state, beta=0.9)


WRAPPERS = [
    ("SkipNonFinite", lambda: optim.SkipNonFinite(optim.Descent(1.0))),
    ("AccumGrad chain", lambda: optim.chain(optim.AccumGrad(1), optim.Descent(1.0))),
    ("MixedPrecision", lambda: optim.MixedPrecision(jnp.float32, optim.Descent(1.0))),
    ("Skip(Mixed(chain))", lambda: optim.SkipNonFinite(optim.MixedPrecision(
        jnp.float32, optim.chain(optim.ClipGrad(10.0), optim.Descent(1.0))))),
    ("chain(Skip(chain))", lambda: optim.chain(optim.ClipGrad(10.0), optim.SkipNonFinite(
        optim.chain(optim.AccumGrad(1), optim.Descent(1.0))))),
    ("from_optax factory", lambda: optim.SkipNonFinite(optim.from_optax(__import__("optax").sgd, lr=1.0))),
]


@pytest.mark.parametrize("name, make", WRAPPERS, ids=[c[0] for c in WRAPPERS])
def test_adjust_reaches_inside_every_wrapper(name, make):
    m = {"w": jnp.array([1.0, 1.0])}
    state = optim.adjust(optim.setup(make(), m), lr=0.25)
    _, new = optim.update(state, m, {"w": jnp.ones(2)})
    np.testing.assert_allclose(new["w"], [0.75, 0.75], rtol=1e-6)


def test_adjust_count_inside_wrapper():
    state = optim.setup(optim.SkipNonFinite(optim.chain(optim.AccumGrad(2), optim.Descent(1.0))), {"w": jnp.ones(1)})
    assert int(optim.adjust(state, n=3).rule.rule.rules[0].n) == 3
    with pytest.raises(ValueError, match="AccumGrad: n must be an integer >= 1"):
        optim.adjust(state, n=0)


def test_adjust_rule_swap_must_fit_the_state():
    m = {"w": jnp.ones(2)}
    state = optim.setup(optim.SkipNonFinite(optim.Descent(0.1)), m)
    with pytest.raises(ValueError, match=r"different optimiser state for 'w'.*setup\(new_rule, model, like=state\)"):
        optim.adjust(state, rule=optim.Adam())
    # A rule with the same state (none) may be swapped in, and then runs.
    swapped = optim.adjust(state, rule=optim.Descent(0.5))
    _, new = optim.update(swapped, m, {"w": jnp.ones(2)})
    np.testing.assert_allclose(new["w"], [0.5, 0.5])
    chain = optim.setup(optim.chain(optim.ClipGrad(1.0), optim.Momentum()), m)
    with pytest.raises(ValueError, match="different optimiser state"):
        optim.adjust(chain, rules=(optim.ClipGrad(1.0), optim.Adam()))


def test_from_optax_factory_int_learning_rate_is_adjustable():
    import optax

    m = {"w": jnp.array([1.0, 1.0])}
    state = optim.adjust(optim.setup(optim.from_optax(optax.sgd, lr=1), m), lr=0.25)
    _, new = optim.update(state, m, {"w": jnp.ones(2)})
    np.testing.assert_allclose(new["w"], [0.75, 0.75], rtol=1e-6)


# ----------------------------------------------------------------------------------------- freeze / thaw
def test_frozen_leaf_takes_no_step_until_thawed():
    """Optimisers.jl F8: y frozen takes no step; after adjust(.2) and thaw it does; freeze(model) is refused."""
    m = {"x": arr(1, 2), "y": (arr(3, 4), jnp.sin)}
    state = optim.freeze(optim.setup(optim.Descent(0.1), m), "y")
    g = {"x": arr(1, 10), "y": (arr(100, 1000), None)}
    state, m = optim.update(state, m, g)
    close(m["x"], [.9, 1])
    close(m["y"][0], [3, 4])
    state = optim.thaw(optim.adjust(state, 0.2))
    state, m = optim.update(state, m, g)
    close(m["y"][0], [-17, -196])
    close(m["x"], [.7, -1])
    with pytest.raises(TypeError, match="optimiser state, not the model"):
        optim.freeze(m)


def test_frozen_member_freezes_group_and_keeps_state():
    w = arr(1, 2)
    m = {"a": w, "b": w, "c": arr(1.0)}
    state = optim.freeze(optim.setup(optim.Momentum(0.1), m), "b")
    assert state["a"].frozen
    s2, m2 = optim.update(state, m, {"a": arr(1, 1), "b": arr(1, 1), "c": arr(1.0)})
    assert m2["a"] is w and m2["b"] is w and s2.stacks[0] is state.stacks[0]
    close(m2["c"], [.9])


def test_freeze_patterns_and_all():
    m = {"enc": {"l0": arr(1.0), "l1": arr(1.0)}, "head": arr(1.0)}
    s = optim.setup(optim.Descent(), m)
    assert [p for p, l in optim.freeze(s, "enc").items() if l.frozen] == ["enc.l0", "enc.l1"]
    assert [p for p, l in optim.freeze(s, "enc.*1").items() if l.frozen] == ["enc.l1"]
    assert all(l.frozen for _, l in optim.freeze(s).items())
    assert not any(l.frozen for _, l in optim.thaw(optim.freeze(s)).items())
    with pytest.raises(ValueError, match="'en' matches no trainable path"):
        optim.freeze(s, "en")        # a prefix must end at a dot
    with pytest.raises(ValueError, match="thaw: 'decoder' matches no trainable path"):
        optim.thaw(s, "decoder")


def test_freeze_exact_path_means_that_path_only():
    m = {"w[0]": jnp.ones(1), "w0": jnp.ones(1), "enc": {"a": jnp.ones(1)}, "enc_b": jnp.ones(1)}
    state = optim.setup(optim.Descent(), m)
    frozen = optim.freeze(state, "w[0]")
    assert [p for p, leaf in frozen.items() if leaf.frozen] == ["w[0]"]
    # A pattern that names no path is a glob (here a character class) or a subtree prefix.
    assert [p for p, leaf in optim.freeze(state, "w[0-9]").items() if leaf.frozen] == ["w0"]
    assert [p for p, leaf in optim.freeze(state, "enc").items() if leaf.frozen] == ["enc.a"]
    assert [p for p, leaf in optim.freeze(state, "enc*").items() if leaf.frozen] == ["enc.a", "enc_b"]


# ----------------------------------------------------------------------------------------------- per-path adjust
def _enc_dec():
    return {"enc": {"w": jnp.arange(1.0, 4.0), "b": jnp.ones(3)}, "dec": {"w": jnp.array([2.0, 2.0, 2.0])}}


def _grads(k):
    return {"enc": {"w": jnp.array([1.0, -2.0, 0.5]) * k, "b": jnp.array([0.3, 0.1, -1.0])},
            "dec": {"w": jnp.array([-1.0, 2.0, 3.0]) / k}}


def test_adjust_by_path_matches_optax_multi_transform():
    """adjust(state, "enc", lr=...) after two steps: enc trains with the new lr, dec with the old, exactly as
    optax.multi_transform with two adams whose lr changes at the same step (inject_hyperparams)."""
    optax = pytest.importorskip("optax")
    model = _enc_dec()
    labels = {"enc": {"w": "enc", "b": "enc"}, "dec": {"w": "dec"}}
    tx = optax.multi_transform({"enc": optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
                                "dec": optax.inject_hyperparams(optax.adam)(learning_rate=0.1)}, labels)
    ostate, omodel = tx.init(model), model
    state, m = optim.setup(optim.Adam(0.1), model), model
    for k in range(1, 6):
        if k == 3:
            state = optim.adjust(state, "enc", lr=0.01)
            ostate.inner_states["enc"].inner_state.hyperparams["learning_rate"] = jnp.asarray(0.01)
        state, m = optim.update(state, m, _grads(k))
        upd, ostate = tx.update(_grads(k), ostate, omodel)
        omodel = optax.apply_updates(omodel, upd)
    jax.tree.map(lambda a, b: close(a, b, rtol=1e-6), m, omodel)
    assert hyper(state["enc.w"].rule.lr) == pytest.approx(0.01, rel=1e-6)
    assert hyper(state["dec.w"].rule.lr) == pytest.approx(0.1, rel=1e-6)


def test_adjust_by_path_keeps_every_parameter_state_and_recompiles_once():
    """The first adjust that singles out part of a rule's parameters compiles once; then adjusting those, the
    others or everything is data only (no trace). States survive the restacking exactly."""
    step, traces = counted_update()

    model = _enc_dec()
    state = optim.setup(optim.Adam(0.1), model)
    state, model = step(state, model, _grads(1))
    before = {p: leaf.state for p, leaf in state.items()}
    state = optim.adjust(state, "enc.*", lr=0.01)
    for p, leaf in state.items():
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), leaf.state, before[p])
    state, model = step(state, model, _grads(2))
    assert len(traces) == 2
    for args in [("enc.*",), ("dec",), ()]:
        state = optim.adjust(state, *args, lr=0.05)
        state, model = step(state, model, _grads(3))
    assert len(traces) == 2
    assert [hyper(state[p].rule.lr) for p in ("enc.w", "enc.b", "dec.w")] == pytest.approx([0.05] * 3, rel=1e-6)


def test_adjust_by_path_of_a_whole_rule_never_recompiles():
    step, traces = counted_update()

    model = _enc_dec()
    state = optim.setup(optim.by_path({"enc": optim.Adam(0.1), "dec": optim.Momentum(0.1)}), model)
    state, model = step(state, model, _grads(1))
    state = optim.adjust(state, "enc", lr=0.02)     # every parameter of the Adam rule: in place
    state = optim.adjust(state, "*", rho=0.5)       # only Momentum has rho: no error for Adam's parameters
    state, model = step(state, model, _grads(2))
    assert len(traces) == 1
    assert hyper(state["enc.b"].rule.lr) == pytest.approx(0.02, rel=1e-6)
    assert hyper(state["dec.w"].rule.rho) == pytest.approx(0.5, rel=1e-6)
    assert hyper(state["dec.w"].rule.lr) == pytest.approx(0.1, rel=1e-6)


def test_adjust_by_path_selects_a_tie_group_through_any_member():
    w = jnp.ones(2)
    state = optim.setup(optim.Descent(0.1), {"emb": w, "head": w, "b": jnp.zeros(2)})
    state = optim.adjust(state, "head", lr=0.5)
    assert hyper(state["emb"].rule.lr) == pytest.approx(0.5, rel=1e-6)
    assert hyper(state["b"].rule.lr) == pytest.approx(0.1, rel=1e-6)
    _, m = optim.update(state, {"emb": w, "head": w, "b": jnp.zeros(2)},
                        {"emb": jnp.ones(2), "head": jnp.ones(2), "b": jnp.ones(2)})
    close(m["emb"], [0.0, 0.0])
    close(m["b"], [-0.1, -0.1])
    assert m["emb"] is m["head"]


def test_adjust_by_path_errors_name_the_pattern():
    state = optim.setup(optim.by_path({"enc": optim.Adam(0.1), "*": optim.Descent(0.1)}), _enc_dec())
    with pytest.raises(ValueError, match="'encoder' matches no trainable path"):
        optim.adjust(state, "encoder", lr=0.1)
    with pytest.raises(TypeError, match="no rule here has beta; adjustable: lr"):
        optim.adjust(state, "dec", beta=(0.5, 0.5))     # Adam has beta, but dec's rule (Descent) has not
    with pytest.raises(TypeError, match="select parameters of a State"):
        optim.adjust(optim.Adam(), "enc", lr=0.1)
    with pytest.raises(TypeError, match="lr given twice"):
        optim.adjust(state, 0.1, lr=0.2)
    with pytest.raises(TypeError, match="at most one positional value"):
        optim.adjust(state, 0.1, 0.2)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        optim.adjust(state, "enc", lr=-1.0)


def test_adjust_by_path_inside_jit_with_traced_value():
    model = _enc_dec()
    state = optim.setup(optim.Descent(1.0), model)
    run = jax.jit(lambda s, lr: optim.update(optim.adjust(s, "enc.b", lr=lr), model, _grads(1))[1])
    got = run(state, 0.5)
    close(got["enc"]["b"], np.ones(3) - 0.5 * np.array([0.3, 0.1, -1.0]))
    close(got["enc"]["w"], np.arange(1.0, 4.0) - np.array([1.0, -2.0, 0.5]))


def test_adjust_by_path_swaps_a_rule_for_part_of_the_model():
    """A field holding a rule may be swapped for the selected parameters only, if the state stays the same (in a
    wrapper that does not look across parameters: see the test below for SkipNonFinite)."""
    model = _enc_dec()
    state = optim.setup(optim.MixedPrecision(optim.Descent(0.1)), model)
    state = optim.adjust(state, "dec", rule=optim.Descent(1.0))
    _, m = optim.update(state, model, _grads(1))
    close(m["dec"]["w"], 2.0 - np.array([-1.0, 2.0, 3.0]))
    close(m["enc"]["b"], 1.0 - 0.1 * np.array([0.3, 0.1, -1.0]))
    with pytest.raises(ValueError, match="different optimiser state for 'dec.w'"):
        optim.adjust(state, "dec", rule=optim.Adam())


# Each example compiles two programs for 65 to 100 parameters: two stacks (at most 64 each), so that a restack
# moves parameters between stacks.
@settings(max_examples=5, deadline=None)
@given(st.lists(st.booleans(), min_size=65, max_size=100), st.integers(1, 2))
def test_property_adjust_by_path_restacks_exactly(chosen, steps):
    """Many same-shape parameters (stacks of at most 64) with Adam state: adjusting a random subset keeps every
    parameter's state bitwise, and the next update gives each parameter the step of its own lr."""
    n = len(chosen)
    model = {f"p{i}": jnp.zeros(2) for i in range(n)}    # zeros: x - (x - step) is the step exactly
    grads = {f"p{i}": jnp.array([1.0, -0.5]) * (i % 7 + 1) for i in range(n)}
    state = optim.setup(optim.Adam(0.1), model)
    for _ in range(steps):
        state, _ = optim.update(state, model, grads)
    picked = [f"p{i}" for i, c in enumerate(chosen) if c]
    if not picked:
        return
    new = optim.adjust(state, *picked, lr=0.01)
    for p in model:
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), new[p].state, state[p].state)
    _, m_new = optim.update(new, model, grads)
    _, m_old = optim.update(state, model, grads)
    for i, p in enumerate(model):
        moved_new, moved_old = np.asarray(model[p] - m_new[p]), np.asarray(model[p] - m_old[p])
        np.testing.assert_allclose(moved_new, moved_old * (0.1 if chosen[i] else 1.0), rtol=2e-5)


def test_reduce_on_plateau_with_adjust_matches_optax_contrib():
    """The README's recipe (a host-side plateau test, then `adjust`) makes the same decisions and steps as
    optax.contrib.reduce_on_plateau on the same values, with its defaults' logic (rtol, patience, cooldown 0)."""
    optax = pytest.importorskip("optax")
    factor, patience, rtol = 0.5, 3, 1e-4
    loss = lambda m: jnp.sum((m["w"] - jnp.array([3.0, -1.0])) ** 2)     # noqa: E731
    with jax.enable_x64(True):
        model = {"w": jnp.zeros(2, jnp.float64)}
        tx = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(factor=factor, patience=patience,
                                                                        rtol=rtol))
        ostate, om = tx.init(model), model
        state, m = optim.setup(optim.Descent(1.0), model), model
        lr, best, bad, lrs = 1.0, float("inf"), 0, []
        traces = []

        @jax.jit
        def step(s, m):
            traces.append(1)
            return optim.update(s, m, jax.grad(loss)(m))

        for _ in range(40):
            val = float(loss(m))
            if val < (1 - rtol) * best:
                best, bad = val, 0
            else:
                bad += 1
                if bad == patience:
                    lr, bad = lr * factor, 0
                    state = optim.adjust(state, lr=lr)
            lrs.append(lr)
            state, m = step(state, m)
            updates, ostate = tx.update(jax.grad(loss)(om), ostate, om, value=loss(om))
            om = optax.apply_updates(om, updates)
            np.testing.assert_allclose(m["w"], om["w"], rtol=1e-12, atol=1e-12)
        assert float(ostate[1].scale) == lr and len(traces) == 1
        assert sorted(set(lrs), reverse=True)[:3] == [1.0, 0.5, 0.25]    # it did reduce, more than once


def test_adjust_by_path_of_a_field_some_selected_rules_lack_splits_nothing():
    model = _enc_dec()
    state = optim.setup(optim.by_path({"enc.w": optim.Momentum(0.1), "*": optim.Adam(0.1)}), model)
    out = optim.adjust(state, "enc", rho=0.5)     # enc.b's Adam has no rho: it keeps its shared rule
    assert out.layout is state.layout and float(out["enc.w"].rule.rho) == 0.5


@pytest.mark.parametrize("make, name", [
    (lambda: optim.chain(optim.ClipGlobalNorm(1.0), optim.Descent(1.0)), "ClipGlobalNorm"),
    (lambda: optim.SkipNonFinite(optim.Adam(0.1)), "SkipNonFinite"),
    (lambda: optim.EMA(optim.SkipLargeUpdates(optim.Adam(0.1), warmup=2)), "SkipLargeUpdates"),
])
def test_per_path_adjust_refuses_to_split_a_rule_that_looks_across_parameters(make, name):
    """A copy of the rule for some of its parameters would clip (or skip) them apart from the others: refused,
    before anything changes; adjusting all of them, or a rule that does not look across, is fine."""
    model = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    state = optim.setup(make(), model)
    with pytest.raises(ValueError, match=rf"adjust: 'b' shares its rule with 1 parameter.*looks across its "
                                         rf"parameters \({name}\).*optim.by_path"):
        optim.adjust(state, "b", lr=0.5)
    assert len(state.rules) == 1                                       # nothing changed
    assert len(optim.adjust(state, "a", "b", lr=0.5).rules) == 1      # every parameter of the rule: in place
    split = optim.adjust(optim.setup(optim.chain(optim.ClipGrad(1.0), optim.Descent(1.0)), model), "b", lr=0.5)
    assert len(split.rules) == 2                                       # per-parameter clipping splits freely


def test_looks_across_sees_through_wrappers_and_flags_unknown_apply_tree():
    from optim._rules.protocol import looks_across

    assert looks_across(optim.Adam()) is None
    assert looks_across(optim.MixedPrecision(optim.chain(optim.Adam(), optim.Scale(0.5)))) is None
    assert looks_across(optim.EMA(optim.chain(optim.ClipNorm(1.0), optim.ClipGlobalNorm(1.0)))) == "ClipGlobalNorm"

    class Mine(optim.Rule):
        def apply_tree(self, states, xs, dxs):
            return states, dxs

    assert looks_across(Mine()) == "Mine"


# ----------------------------------------------------------------------------------------------- β and bias correction
# The rules whose bias correction keeps the products of their decay rates (`bt`), with a β pair (β₁, β₂).
POWER_RULES = {
    "Adam": lambda **k: optim.Adam(0.1, **k),
    "AdamW": lambda **k: optim.AdamW(0.1, weight_decay=0.01, **k),
    "NAdam": lambda **k: optim.NAdam(0.1, **k),
    "RAdam": lambda **k: optim.RAdam(0.1, **k),
    "AdaBelief": lambda **k: optim.AdaBelief(0.1, **k),
    "AdEMAMix": lambda **k: optim.AdEMAMix(0.1, **k),
    "AdaMax": lambda **k: optim.AdaMax(0.1, **k),
    "OAdam": lambda **k: optim.OAdam(0.1, **k),
    "Lamb": lambda **k: optim.Lamb(0.1, **k),
}


def _steps(state, x, n, start=0):
    for t in range(start, start + n):
        state, x = optim.update(state, x, jnp.sin(jnp.arange(1.0, 5.0) * (t + 1)) + 0.2)
    return state, x


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "xla"])
@pytest.mark.parametrize("name", sorted(POWER_RULES))
def test_adjusted_beta_before_the_first_step_trains_as_if_given_at_setup(name, kernel, monkeypatch):
    """`adjust(setup(R(), x), beta=b)` is `setup(R(beta=b), x)`: the bias correction starts from the β in force at
    the first step, not the one given at setup (Adam's first step would be η/2, AdaMax's 5η)."""
    monkeypatch.setattr(_fused, "ENABLED", kernel)
    x = jnp.array([1.0, -2.0, 3.0, 0.5])
    got = _steps(optim.adjust(optim.setup(POWER_RULES[name](), x), beta=(0.5, 0.9)), x, 3)[1]
    want = _steps(optim.setup(POWER_RULES[name](beta=(0.5, 0.9)), x), x, 3)[1]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _adam_reference(betas, grads, x, lr=0.1, eps=1e-8):
    """Adam in float64 with a β pair per step and the bias correction 1 - ∏β (the weight the moment's average
    has put on gradients so far)."""
    x, m, v, p1, p2 = np.array(x, np.float64), 0.0, 0.0, 1.0, 1.0
    for (b1, b2), g in zip(betas, grads):
        m, v, p1, p2 = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, p1 * b1, p2 * b2
        x = x - lr * (m / (1 - p1)) / (np.sqrt(v / (1 - p2)) + eps)
    return x


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "xla"])
def test_a_mid_run_beta_change_debiases_with_the_product_of_the_betas_used(kernel, monkeypatch):
    """Changing β mid-run (`adjust`) keeps each moment's bias correction exact: 1 - ∏β over the steps taken, the
    total weight its average has given the gradients (optax's inject_hyperparams uses 1 - βᵗ of the new β)."""
    monkeypatch.setattr(_fused, "ENABLED", kernel)
    x = jnp.array([1.0, -2.0, 3.0, 0.5], jnp.float32)
    grads = [np.sin(np.arange(1.0, 5.0) * (t + 1)) + 0.2 for t in range(5)]
    state = optim.setup(optim.Adam(0.1), x)
    y = x
    for t in range(5):
        if t == 2:
            state = optim.adjust(state, beta=(0.5, 0.99))
        state, y = optim.update(state, y, jnp.asarray(grads[t], jnp.float32))
    want = _adam_reference([(0.9, 0.999)] * 2 + [(0.5, 0.99)] * 3, grads, x)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-6)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "xla"])
@pytest.mark.parametrize("name", sorted(POWER_RULES))
def test_beta_schedules_are_accepted_by_the_adam_family(name, kernel, monkeypatch):
    """β₁ and β₂ may be schedules, as every numeric hyperparameter (they were a TypeError in `setup`)."""
    monkeypatch.setattr(_fused, "ENABLED", kernel)
    x = jnp.array([1.0, -2.0, 3.0, 0.5])
    rule = POWER_RULES[name](beta=(optim.Linear(0.5, 0.9, 4), optim.Linear(0.9, 0.999, 4)))
    state, y = _steps(optim.setup(rule, x), x, 3)
    assert np.all(np.isfinite(np.asarray(y))) and not np.array_equal(np.asarray(y), np.asarray(x))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "xla"])
def test_adam_with_a_beta_schedule_matches_the_float64_reference(kernel, monkeypatch):
    monkeypatch.setattr(_fused, "ENABLED", kernel)
    x = jnp.array([1.0, -2.0, 3.0, 0.5], jnp.float32)
    grads = [np.sin(np.arange(1.0, 5.0) * (t + 1)) + 0.2 for t in range(5)]
    state = optim.setup(optim.Adam(0.1, beta=(optim.Linear(0.5, 0.9, 4), 0.99)), x)
    y = x
    for g in grads:
        state, y = optim.update(state, y, jnp.asarray(g, jnp.float32))
    b1 = [0.5 + 0.4 * min(t, 4) / 4 for t in range(5)]
    np.testing.assert_allclose(np.asarray(y), _adam_reference([(b, 0.99) for b in b1], grads, x), rtol=2e-6)


def test_pair_of_refuses_what_is_not_a_pair():
    """A rule author's `pair_of((a, b, c), x)` once returned `(a, b)` silently."""
    from optim._rules.protocol import pair_of, tuple_of

    x = jnp.ones(2)
    with pytest.raises(ValueError, match="expected a pair of numbers, got 3.*tuple_of"):
        pair_of((0.9, 0.99, 0.999), x)
    assert [float(b) for b in tuple_of((0.5, 0.25, 0.125), x)] == [0.5, 0.25, 0.125]


def test_bias_correction_helpers_take_any_number_of_decay_rates():
    """`bt_init`, `bt_next` and `debias` with three rates (an Adan-like rule; docs/development.md writes one):
    after two steps each product is β², each factor 1 / (1 - β²)."""
    from optim._rules.moments import bt_init, bt_next, debias

    beta, x = (0.5, 0.75, 0.875), jnp.ones(3)
    bt = bt_next(bt_next(bt_init(beta, x), beta, x), beta, x)
    np.testing.assert_allclose(np.asarray(bt), [0.25, 0.5625, 0.765625])
    np.testing.assert_allclose([float(c) for c in debias(bt)], [1 / 0.75, 1 / 0.4375, 1 / 0.234375], rtol=1e-6)
