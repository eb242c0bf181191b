"""Schedules: values, evaluation on device from the state's step counter, no recompilation, optax parity."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim


@pytest.mark.parametrize("sched, expect", [
    (optim.Constant(0.3), {0: 0.3, 7: 0.3}),
    (optim.Linear(1.0, 0.0, 10), {0: 1.0, 5: 0.5, 10: 0.0, 20: 0.0}),
    (optim.Cosine(1.0, 10), {0: 1.0, 5: 0.5, 10: 0.0, 15: 0.0}),
    (optim.Cosine(1.0, 10, final=0.2), {5: 0.6, 10: 0.2}),
    (optim.Piecewise((3, 6), (1.0, 0.5, 0.1)), {0: 1.0, 2: 1.0, 3: 0.5, 6: 0.1, 100: 0.1}),
    (optim.Join((optim.Constant(1.0), optim.Linear(1.0, 0.0, 4)), (2,)), {1: 1.0, 2: 1.0, 4: 0.5, 6: 0.0}),
])
def test_schedule_values(sched, expect):
    for t, v in expect.items():
        assert float(sched(jnp.int32(t))) == pytest.approx(v, abs=1e-6)
        assert float(jax.jit(sched)(jnp.int32(t))) == pytest.approx(v, abs=1e-6)


def test_warmup_cosine_matches_optax():
    ours = optim.warmup_cosine(2e-3, 10, 100, init=1e-4, final=1e-5)
    ref = optax.warmup_cosine_decay_schedule(1e-4, 2e-3, 10, 100, 1e-5)
    for t in [0, 1, 5, 9, 10, 11, 50, 99, 100, 150]:
        assert float(ours(jnp.int32(t))) == pytest.approx(float(ref(t)), rel=1e-5)


def test_schedule_in_a_rule_steps_with_the_counter_and_never_recompiles():
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *a, **k: compiles.append(event) if event.endswith("backend_compile_duration") else None)
    m = {"x": jnp.zeros(1)}
    state = optim.setup(optim.Descent(optim.Linear(1.0, 0.0, 4)), m)
    g = {"x": jnp.ones(1)}
    xs = []
    for _ in range(5):
        state, m = optim.update(state, m, g)
        xs.append(float(m["x"][0]))
    np.testing.assert_allclose(xs, [-1, -1.75, -2.25, -2.5, -2.5])
    assert int(state.step) == 5
    n = len(compiles)
    state = optim.adjust(state, lr=optim.Linear(2.0, 0.0, 8))     # same schedule kind: data only
    state, m = optim.update(state, m, g)
    assert len(compiles) == n
    np.testing.assert_allclose(m["x"], [-2.5 - 2.0 * (1 - 5 / 8)])


def test_adamw_with_schedule_matches_optax_over_20_steps():
    sched_o = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 20, 1e-4)
    sched = optim.warmup_cosine(1e-2, 5, 20, final=1e-4)
    key = jax.random.PRNGKey(0)
    params = {"w": jax.random.normal(key, (4, 3)), "b": jnp.zeros(3)}
    loss = lambda p: jnp.sum(jnp.tanh(p["w"] @ p["b"] + 1.0) ** 2) + jnp.sum(p["w"] ** 2)
    tx = optax.adamw(sched_o, weight_decay=0.1)
    po, so = params, tx.init(params)
    state, pm = optim.setup(optim.AdamW(sched, weight_decay=0.1), params), params
    step = jax.jit(lambda s, p: optim.update(s, p, jax.grad(loss)(p)))
    for _ in range(20):
        u, so = tx.update(jax.grad(loss)(po), so, po)
        po = optax.apply_updates(po, u)
        state, pm = step(state, pm)
    for k in params:
        np.testing.assert_allclose(pm[k], po[k], rtol=1e-5, atol=1e-6)


def test_schedule_validation():
    with pytest.raises(ValueError, match="one more value"):
        optim.Piecewise((1, 2), (1.0,))
    with pytest.raises(ValueError, match="one more schedule"):
        optim.Join((optim.Constant(1.0),), (3,))


# ----------------------------------------------------------------------------------------- hardening
@pytest.mark.parametrize("make, err, match", [
    (lambda: optim.Linear(1.0, 0.0, 0), ValueError, "Linear: steps must be > 0 \\(the schedule divides by it\\)"),
    (lambda: optim.Cosine(1.0, 0), ValueError, "Cosine: steps must be > 0"),
    (lambda: optim.Cosine(1.0, -5), ValueError, "Cosine: steps must be > 0"),
    (lambda: optim.Linear(1.0, 0.0, float("inf")), ValueError, "Linear: steps must be > 0 .* and finite"),
    (lambda: optim.Linear(1.0, float("nan"), 10), ValueError, "Linear: end must be a number and finite"),
    (lambda: optim.Constant(float("inf")), ValueError, "Constant: value must be a number and finite"),
    (lambda: optim.Constant("1e-3"), TypeError, "Constant: value must be a real number"),
    (lambda: optim.Piecewise((-1,), (1.0, 0.5)), ValueError, r"Piecewise: boundaries\[0\] must be >= 0"),
    (lambda: optim.Piecewise(3, (1.0, 0.5)), TypeError, "Piecewise: boundaries and values are tuples"),
    (lambda: optim.Join((optim.Constant(1.0), 0.5), (3,)), TypeError, r"Join: schedules\[1\] is float"),
    (lambda: optim.warmup_cosine(1.0, 10, 10), ValueError, "warmup_cosine: decay_steps \\(10\\) counts from the start"),
    (lambda: optim.warmup_cosine(1.0, 10, 5), ValueError, "must be greater than warmup_steps"),
    (lambda: optim.warmup_cosine(1.0, -1, 5), ValueError, "warmup_cosine: warmup_steps must be >= 0"),
])
def test_degenerate_schedules_refused_at_construction(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_warmup_cosine_without_warmup_matches_optax():
    ours = optim.warmup_cosine(1.0, 0, 10, final=0.1)
    ref = optax.warmup_cosine_decay_schedule(0.0, 1.0, 0, 10, 0.1)
    for t in [0, 1, 5, 10, 11]:
        assert float(ours(jnp.int32(t))) == pytest.approx(float(ref(t)), rel=1e-6)


def test_traced_zero_length_gives_end_value_not_nan():
    # A length that arrives traced cannot be checked at construction; the formula still never divides by 0.
    lin = jax.jit(lambda n, t: optim.Linear(1.0, 0.25, n)(t))
    cos = jax.jit(lambda n, t: optim.Cosine(1.0, n, final=0.25)(t))
    for f in (lin, cos):
        assert float(f(jnp.float32(0.0), jnp.int32(0))) == 0.25
        assert float(f(jnp.float32(0.0), jnp.int32(5))) == 0.25


@pytest.mark.parametrize("sched, half", [
    (optim.Linear(1, 0, 10), optim.Linear(0.5, 0.0, 10)),
    (optim.Cosine(1, 10), optim.Cosine(0.5, 10)),
    (optim.Constant(1), optim.Constant(0.5)),
    (optim.Piecewise((2,), (1, 0)), optim.Piecewise((2,), (0.5, 0.0))),
    (optim.warmup_cosine(1, 2, 10, init=1), optim.warmup_cosine(0.5, 2, 10, init=0.5)),
], ids=["Linear", "Cosine", "Constant", "Piecewise", "warmup_cosine"])
def test_int_schedule_adjusted_to_floats_is_not_truncated(sched, half):
    assert all(np.isfinite([float(sched(jnp.int32(t))) for t in range(14)]))
    state = optim.setup(optim.Descent(sched), {"w": jnp.ones(1)})
    adjusted = optim.adjust(state, lr=half)
    got = float(optim.update(adjusted, {"w": jnp.zeros(1)}, {"w": jnp.ones(1)})[1]["w"][0])
    assert got == pytest.approx(-0.5, rel=1e-6)
