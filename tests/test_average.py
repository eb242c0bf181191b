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
