"""EMA and averaged (optim/_rules/average.py): the running average against numpy and optax.ema, ties kept, no
average advanced without a step, wrappers in either order, stacking, jit, checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from conftest import close, counted_update


def _grads(k, model):
    return jax.tree.map(lambda x: jnp.sin(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape) + k), model)


def _reference(rule, model, grads_seq, decay):
    """numpy: run `rule` alone and average the parameters after each step."""
    state = optim.setup(rule, model)
    avg = jax.tree.map(lambda x: np.asarray(x, np.float64), model)
    for g in grads_seq:
        state, model = optim.update(state, model, g)
        avg = jax.tree.map(lambda a, x: decay * a + (1 - decay) * np.asarray(x, np.float64), avg, model)
    return model, avg


def test_ema_of_adam_matches_numpy_and_optax_ema():
    optax = pytest.importorskip("optax")
    model = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    seq = [_grads(k, model) for k in range(20)]
    state, m = optim.setup(optim.EMA(optim.Adam(0.05), decay=0.9), model), model
    for g in seq:
        state, m = optim.update(state, m, g)
    ref_model, ref_avg = _reference(optim.Adam(0.05), model, seq, 0.9)
    jax.tree.map(lambda a, b: close(a, b, rtol=1e-6), m, ref_model)        # the steps are Adam's
    jax.tree.map(lambda a, b: close(a, b, rtol=1e-5), optim.averaged(state, m), ref_avg)
    # optax.ema fed with the parameters after each step, its state starting at the initial parameters.
    ema = optax.ema(0.9, debias=False)
    est = ema.init(model)._replace(ema=model)
    p = model
    astate = optim.setup(optim.Adam(0.05), model)
    for g in seq:
        astate, p = optim.update(astate, p, g)
        _, est = ema.update(p, est)
    jax.tree.map(lambda a, b: close(a, b, rtol=1e-5), optim.averaged(state, m), est.ema)


def test_averaged_keeps_ties_and_transformed_ties():
    w = jnp.arange(6.0).reshape(2, 3)
    model = {"emb": w, "head": w, "proj": w.T, "n": 1}
    state = optim.setup(optim.EMA(optim.Descent(0.5), 0.8), model, ties={"proj": ("emb", jnp.transpose)})
    grads = {"emb": jnp.ones((2, 3)), "head": jnp.ones((2, 3)), "proj": jnp.ones((3, 2)), "n": None}
    state, m = optim.update(state, model, grads)
    avg = optim.averaged(state, m)
    # One parameter: the three gradients summed (3 per entry), one step of 0.5 * 3, averaged with decay 0.8.
    expect = 0.8 * np.asarray(w) + 0.2 * (np.asarray(w) - 1.5)
    close(avg["emb"], expect)
    assert avg["emb"] is avg["head"] and avg["n"] == 1
    close(avg["proj"], expect.T)
    jitted = jax.jit(optim.averaged)(state, m)
    close(jitted["head"], expect)
    close(jitted["proj"], expect.T)


def test_no_step_leaves_the_average():
    """A None gradient, a frozen parameter, AccumGrad's accumulating calls and SkipNonFinite's skipped steps
    do not move the average."""
    model = {"a": jnp.ones(2), "b": jnp.ones(2)}
    g = {"a": jnp.ones(2), "b": jnp.ones(2)}
    state = optim.setup(optim.EMA(optim.Descent(1.0), 0.5), model)
    state, m = optim.update(state, model, {"a": g["a"], "b": None})
    avg = optim.averaged(state, m)
    close(avg["a"], [0.5, 0.5])
    close(avg["b"], [1.0, 1.0])
    state = optim.freeze(state, "a")
    state, m = optim.update(state, m, g)
    avg = optim.averaged(state, m)
    close(avg["a"], [0.5, 0.5])
    close(avg["b"], [0.5, 0.5])

    accum = optim.setup(optim.EMA(optim.chain(optim.AccumGrad(2), optim.Descent(1.0)), 0.5), model)
    accum, m = optim.update(accum, model, g)           # accumulates: no step
    close(optim.averaged(accum, m)["a"], [1.0, 1.0])
    accum, m = optim.update(accum, m, g)               # steps by the mean gradient, 1
    close(m["a"], [0.0, 0.0])
    close(optim.averaged(accum, m)["a"], [0.5, 0.5])

    for rule in (optim.EMA(optim.SkipNonFinite(optim.Descent(1.0)), 0.5),
                 optim.SkipNonFinite(optim.EMA(optim.Descent(1.0), 0.5))):
        s, m = optim.update(optim.setup(rule, model), model, {"a": jnp.array([1.0, jnp.nan]), "b": g["b"]})
        close(optim.averaged(s, m)["b"], [1.0, 1.0], err_msg=repr(rule))
        s, m = optim.update(s, m, g)
        close(optim.averaged(s, m)["b"], [0.5, 0.5], err_msg=repr(rule))


def test_low_precision_parameters_average_in_float32():
    """A bfloat16 parameter's average is kept in float32: 200 steps of 1e-3 are far below bfloat16's precision
    at 1.0, yet the average moves; MixedPrecision(EMA(...)) averages the float32 master copy."""
    x = jnp.ones(4, jnp.bfloat16)
    for rule in (optim.EMA(optim.Descent(1e-3), 0.9), optim.MixedPrecision(optim.EMA(optim.Descent(1e-3), 0.9))):
        state, m = optim.setup(rule, x), x
        for _ in range(200):
            state, m = optim.update(state, m, jnp.ones(4, jnp.bfloat16))
        avg = optim.averaged(state, m)
        assert avg.dtype == jnp.bfloat16
        # numpy in float64 of the float32 master (MixedPrecision) or of the bfloat16 parameter (EMA alone).
        if isinstance(rule, optim.MixedPrecision):
            xs = 1.0 - 1e-3 * np.arange(1, 201)
        else:
            xs, v = [], np.float32(1.0)
            for _ in range(200):
                v = np.float32(jnp.asarray(v, jnp.bfloat16) - jnp.asarray(1e-3, jnp.bfloat16))
                xs.append(float(jnp.asarray(v, jnp.bfloat16)))
            xs = np.array(xs)
        a = 1.0
        for v in xs:
            a = 0.9 * a + 0.1 * v
        np.testing.assert_allclose(np.asarray(avg, np.float32), np.float32(jnp.asarray(a, jnp.bfloat16)), rtol=1e-2)
        inner = state[""].state
        ema_state = inner[1] if isinstance(rule, optim.MixedPrecision) else inner
        assert ema_state[1].dtype == jnp.float32


def test_stacked_parameters_and_a_rule_per_path():
    """70 small same-shape parameters share a stack; by_path gives only some of them an EMA."""
    model = {f"p{i}": jnp.full(3, float(i)) for i in range(70)}
    model["big"] = jnp.ones(10000)
    rule = optim.by_path({"p1*": optim.EMA(optim.Descent(0.1), 0.5), "*": optim.Descent(0.1)})
    state, m = optim.setup(rule, model), model
    for k in range(3):
        state, m = optim.update(state, m, _grads(k, model))
    avg = optim.averaged(state, m)
    _, ref = _reference(optim.Descent(0.1), {"p1": model["p1"], "p12": model["p12"]},
                        [{"p1": _grads(k, model)["p1"], "p12": _grads(k, model)["p12"]} for k in range(3)], 0.5)
    close(avg["p1"], ref["p1"], rtol=1e-6)
    close(avg["p12"], ref["p12"], rtol=1e-6)
    assert avg["p2"] is m["p2"] and avg["big"] is m["big"]


def test_decay_adjusts_without_retrace_and_may_be_a_schedule():
    step, traces = counted_update()

    model = {"w": jnp.zeros(2)}
    g = {"w": jnp.ones(2)}
    state = optim.setup(optim.EMA(optim.Descent(1.0), decay=optim.Linear(0.0, 0.5, 2)), model)
    state, model = step(state, model, g)             # decay 0: the average is the parameter, -1
    close(optim.averaged(state, model)["w"], [-1.0, -1.0])
    state = optim.adjust(state, decay=0.5)
    state, model = step(state, model, g)             # 0.5 · -1 + 0.5 · -2
    close(optim.averaged(state, model)["w"], [-1.5, -1.5])
    assert len(traces) == 2                          # the schedule became a number: one new structure
    state = optim.adjust(state, decay=0.25)
    state, model = step(state, model, g)
    assert len(traces) == 2
    close(optim.averaged(state, model)["w"], [-0.25 * 1.5 - 0.75 * 3.0] * 2)


def test_averaged_errors():
    model = {"w": jnp.zeros(2)}
    with pytest.raises(ValueError, match="no rule in this state keeps an average"):
        optim.averaged(optim.setup(optim.Adam(), model), model)
    with pytest.raises(TypeError, match="expected the State from optim.setup"):
        optim.averaged(model, model)
    state = optim.setup(optim.EMA(optim.Adam()), model)
    with pytest.raises(ValueError, match="averaged: the model does not have the structure"):
        optim.averaged(state, {"v": jnp.zeros(2)})
    with pytest.raises(TypeError, match="EMA: rule must be a rule"):
        optim.EMA(0.999)
    with pytest.raises(ValueError, match="EMA: decay must be in \\[0, 1\\]"):
        optim.EMA(optim.Adam(), decay=1.5)


def test_ema_state_saves_and_donates(tmp_path):
    w = jnp.ones(3)
    model = {"emb": w, "head": w}
    rule = optim.EMA(optim.Adam(0.1), 0.9)
    state = optim.setup(rule, model)
    g = {"emb": jnp.ones(3), "head": jnp.ones(3)}
    state, model = optim.update(state, model, g, donate=True)    # the average is not the model's buffer
    state, model = optim.update(state, model, g, donate=True)
    optim.save(tmp_path / "s.optim", state, model)
    v = jnp.ones(3)                                               # w itself was donated
    back, m2 = optim.load(tmp_path / "s.optim", (optim.setup(rule, {"emb": v, "head": v}), {"emb": v, "head": v}))
    avg = optim.averaged(back, m2)
    close(avg["head"], optim.averaged(state, model)["head"])
    assert avg["emb"] is avg["head"]


# ----------------------------------------------------------------------------------------------- where EMA may sit
def _decay0(rule):
    return optim.EMA(rule, decay=0.0)


# With decay 0 the average is the parameter after each step; these are the placements where EMA sees the whole step.
_SUPPORTED = {
    "EMA(Adam)": lambda: _decay0(optim.Adam(0.05)),
    "EMA(chain(ClipGlobalNorm, AdamW))": lambda: _decay0(optim.chain(optim.ClipGlobalNorm(1.0),
                                                                     optim.AdamW(0.05, weight_decay=0.1))),
    "EMA(chain(Adam, Scale))": lambda: _decay0(optim.chain(optim.Adam(0.05), optim.Scale(0.5))),
    "EMA(chain(Momentum, ClipNorm))": lambda: _decay0(optim.chain(optim.Momentum(0.05), optim.ClipNorm(0.01))),
    "EMA(EMA(Lion))": lambda: _decay0(_decay0(optim.Lion(0.01))),
    "SkipNonFinite(EMA(chain(ClipGlobalNorm, AdamW)))": lambda: optim.SkipNonFinite(_decay0(optim.chain(
        optim.ClipGlobalNorm(1.0), optim.AdamW(0.05, weight_decay=0.1)))),
    "SkipLargeUpdates(EMA(Momentum))": lambda: optim.SkipLargeUpdates(_decay0(optim.Momentum(0.05)), sigma=0.5,
                                                                      warmup=1),
    "MixedPrecision(EMA(Adam))": lambda: optim.MixedPrecision(_decay0(optim.Adam(0.05))),
    "chain(ClipGlobalNorm, EMA(AdamW))": lambda: optim.chain(optim.ClipGlobalNorm(1.0),
                                                             _decay0(optim.AdamW(0.05, weight_decay=0.1))),
    "chain(AccumGrad(2), EMA(Descent))": lambda: optim.chain(optim.AccumGrad(2), _decay0(optim.Descent(0.1))),
    "chain(ClipNorm, SkipNonFinite(EMA(Adam)))": lambda: optim.chain(optim.ClipNorm(1.0),
                                                                     optim.SkipNonFinite(_decay0(optim.Adam(0.05)))),
    "by_path(EMA on b only)": lambda: optim.by_path({"layer.b": _decay0(optim.chain(optim.ClipNorm(1.0),
                                                                                   optim.Adam(0.05))),
                                                     "*": optim.chain(optim.Adam(0.05), optim.Scale(0.5))}),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(_SUPPORTED))
def test_decay_zero_averages_the_parameter_wherever_ema_may_sit(name, jit):
    """EMA with decay 0 in every placement `setup` accepts: after each step (including AccumGrad's accumulating
    calls and SkipLargeUpdates' skipped ones) `averaged` is exactly the model."""
    model = {"layer": {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2), "b": jnp.array([0.5, -0.25])}}
    state = optim.setup(_SUPPORTED[name](), model)
    step = jax.jit(optim.update) if jit else optim.update
    m = model
    for k in range(5):
        g = jax.tree.map(lambda x: x * (10.0 if k == 3 else 1.0), _grads(k, model))   # k = 3: a large step
        state, m = step(state, m, g)
        avg = optim.averaged(state, m)
        # Equal, to 1 ulp (rtol 2^-23): under SkipNonFinite the average is taken inside its conditional, where XLA
        # may contract `x - step` with the step's last product into one fused multiply-add, while the model
        # subtracts the step the conditional returned, rounded (1 ulp seen on CPU; 0 in the other placements).
        jax.tree.map(lambda a, x: close(a, x, rtol=2.0 ** -23, atol=0, err_msg=f"{name}, step {k + 1}"), avg, m)
    assert not np.array_equal(np.asarray(m["layer"]["b"]), np.asarray(model["layer"]["b"]))     # it moved


_REFUSED = {
    "chain(EMA(Adam), Scale)": (lambda: optim.chain(optim.EMA(optim.Adam(0.05)), optim.Scale(0.5)),
                                "stage 1 of the 2", "EMA(rule=OptimiserChain(Adam(", "Scale(f=0.5)), decay=0.999)"),
    "chain(EMA(Adam), ClipNorm)": (lambda: optim.chain(optim.EMA(optim.Adam(0.05), 0.9), optim.ClipNorm(1.0)),
                                   "stage 1 of the 2", "EMA(rule=OptimiserChain(Adam(", "ClipNorm(", "decay=0.9)"),
    "chain(ClipGlobalNorm, EMA(AdamW), Scale)": (
        lambda: optim.chain(optim.ClipGlobalNorm(1.0), optim.EMA(optim.AdamW(0.05)), optim.Scale(0.5)),
        "stage 2 of the 3", "EMA(rule=OptimiserChain(ClipGlobalNorm(max_norm=1), AdamW("),
    "chain(SkipNonFinite(EMA(Adam)), Scale)": (
        lambda: optim.chain(optim.SkipNonFinite(optim.EMA(optim.Adam(0.05))), optim.Scale(0.5)),
        "stage 1 of the 2", "EMA(rule=OptimiserChain(SkipNonFinite(rule=Adam("),
    "chain(chain(ClipGlobalNorm, EMA(Adam)), Scale)": (
        lambda: optim.chain(optim.chain(optim.ClipGlobalNorm(1.0), optim.EMA(optim.Adam(0.05))), optim.Scale(0.5)),
        "stage 1 of the 2", "EMA(rule=OptimiserChain(OptimiserChain(ClipGlobalNorm(max_norm=1), Adam("),
    "SkipNonFinite(chain(EMA(Adam), Scale))": (
        lambda: optim.SkipNonFinite(optim.chain(optim.EMA(optim.Adam(0.05)), optim.Scale(0.5))), "stage 1 of the 2"),
    "MixedPrecision(chain(EMA(Adam), Scale))": (
        lambda: optim.MixedPrecision(optim.chain(optim.EMA(optim.Adam(0.05)), optim.Scale(0.5))), "stage 1 of the 2"),
    "EMA(chain(EMA(Adam), Scale))": (
        lambda: optim.EMA(optim.chain(optim.EMA(optim.Adam(0.05)), optim.Scale(0.5))), "stage 1 of the 2"),
    "Cautious(EMA(AdamW))": (lambda: optim.Cautious(optim.EMA(optim.AdamW(0.05, weight_decay=0.1), 0.9)),
                             "inside Cautious, which masks", "EMA(rule=Cautious(rule=AdamW(", "decay=0.9)"),
    "Cautious(chain(ClipGlobalNorm, EMA(AdamW)))": (
        lambda: optim.Cautious(optim.chain(optim.ClipGlobalNorm(1.0), optim.EMA(optim.AdamW(0.05)))),
        "inside Cautious", "EMA(rule=Cautious(rule=OptimiserChain(ClipGlobalNorm(max_norm=1), AdamW("),
}


@pytest.mark.parametrize("name", list(_REFUSED))
def test_ema_that_would_average_a_point_never_taken_is_refused_at_setup(name):
    """An EMA with something after it that changes the step (a later stage of a chain, Cautious' mask) would
    average x minus its own rule's step: `setup` refuses it with a ValueError naming the parameter's path and
    the form to write; that form is accepted and averages the parameter (decay 0)."""
    make, *says = _REFUSED[name]
    model = {"layer": {"w": jnp.ones((3, 2))}}
    with pytest.raises(ValueError, match=r"^setup: at 'layer\.w': EMA: EMA\(rule=") as e:
        optim.setup(make(), model)
    msg = str(e.value)
    assert "a point the model never takes" in msg and "An EMA must see the whole step: put it outermost, EMA(" in msg
    for s in says:
        assert s in msg, (s, msg)
    # The form the message gives (its EMA with decay 0) sets up, and its average is the parameter.
    fixed = msg.split("put it outermost, ", 1)[1].removesuffix(" (or make it the chain's last stage)")
    rule = eval(fixed, {**vars(optim), "float32": jnp.float32})
    rule = optim.EMA(rule.rule, decay=0.0)
    state, m = optim.setup(rule, model), model
    for k in range(2):
        state, m = optim.update(state, m, _grads(k, model))
    close(optim.averaged(state, m)["layer"]["w"], m["layer"]["w"], rtol=0, atol=0)


def test_refused_ema_by_path_names_its_parameter():
    """With a rule per path, the refusal names the parameter given the misplaced EMA; others may have any EMA."""
    model = {"enc": {"w": jnp.ones(3)}, "dec": {"w": jnp.ones(2)}, "head": jnp.ones(4)}
    rule = optim.by_path({"dec.*": optim.chain(optim.EMA(optim.Adam(0.1)), optim.Scale(0.5)),
                          "enc.*": optim.EMA(optim.chain(optim.Adam(0.1), optim.Scale(0.5))), "*": optim.Adam(0.1)})
    with pytest.raises(ValueError, match=r"^setup: at 'dec\.w': EMA: .* is in stage 1 of the 2 of "):
        optim.setup(rule, model)
    pick = lambda path, x: (optim.Cautious(optim.EMA(optim.Lion(0.1))) if path == "head"
                            else optim.EMA(optim.Cautious(optim.Lion(0.1))))
    with pytest.raises(ValueError, match=r"^setup: at 'head': EMA: .* is inside Cautious"):
        optim.setup(pick, model)
