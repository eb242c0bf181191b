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


def _adamw_matches_optax(sched, sched_o, seed, steps):
    """AdamW with `sched` as its lr against `optax.adamw` with `sched_o`, on a small model, step by step."""
    params = {"w": jax.random.normal(jax.random.PRNGKey(seed), (4, 3)), "b": jnp.zeros(3)}
    loss = lambda p: jnp.sum(jnp.tanh(p["w"] @ p["b"] + 1.0) ** 2) + jnp.sum(p["w"] ** 2)
    tx = optax.adamw(sched_o, weight_decay=0.1)
    po, so = params, tx.init(params)
    state, pm = optim.setup(optim.AdamW(sched, weight_decay=0.1), params), params
    step = jax.jit(lambda s, p: optim.update(s, p, jax.grad(loss)(p)))
    for _ in range(steps):
        u, so = tx.update(jax.grad(loss)(po), so, po)
        po = optax.apply_updates(po, u)
        state, pm = step(state, pm)
    for k in params:
        np.testing.assert_allclose(pm[k], po[k], rtol=1e-5, atol=1e-6)


def test_adamw_with_schedule_matches_optax_over_20_steps():
    _adamw_matches_optax(optim.warmup_cosine(1e-2, 5, 20, final=1e-4),
                         optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 20, 1e-4), seed=0, steps=20)


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


@pytest.mark.parametrize("make, err, match", [
    (lambda: optim.warmup_cosine(float("nan"), 10, 100), ValueError, r"^warmup_cosine: peak must be a number and "
                                                                     r"finite, got nan$"),
    (lambda: optim.warmup_cosine(1.0, 10, 100, init=float("inf")), ValueError, r"^warmup_cosine: init must be"),
    (lambda: optim.warmup_cosine(1.0, 10, 100, final=float("nan")), ValueError, r"^warmup_cosine: final must be"),
    (lambda: optim.warmup_cosine(1.0, 0, 100, final=float("nan")), ValueError, r"^warmup_cosine: final must be"),
    (lambda: optim.warmup_cosine("1e-3", 10, 100), TypeError, r"^warmup_cosine: peak must be a real number"),
    (lambda: optim.warmup_cosine(optim.Constant(1.0), 10, 100), TypeError,
     r"^warmup_cosine: peak must be a number, got the schedule Constant"),
])
def test_warmup_cosine_errors_name_its_own_arguments(make, err, match):
    """The user wrote warmup_cosine(peak, ...), not Cosine(init, ...): errors name that function's arguments."""
    with pytest.raises(err, match=match):
        make()


def test_piecewise_and_join_refuse_unsorted_boundaries():
    with pytest.raises(ValueError, match=r"Piecewise: boundaries must be in increasing order \(each is the step "
                                         r"where the next piece starts\), but boundaries\[1\] = 5 comes after "
                                         r"boundaries\[0\] = 10"):
        optim.Piecewise((10, 5), (1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match=r"Join: boundaries must be in increasing order .* boundaries\[2\] = 3 "
                                         r"comes after boundaries\[1\] = 20"):
        optim.Join((optim.Constant(1.0),) * 4, (10, 20, 3))
    # equal boundaries are an empty piece: accepted
    s = optim.Piecewise((5, 5), (1.0, 2.0, 3.0))
    assert [float(s(t)) for t in (4, 5, 6)] == [1.0, 3.0, 3.0]
    # a traced boundary cannot be checked; the concrete ones still are
    assert float(jax.jit(lambda b: optim.Piecewise((b, 8), (1.0, 2.0, 3.0))(6))(4)) == 2.0


def test_schedule_numbers_cannot_be_schedules():
    with pytest.raises(TypeError, match=r"Linear: start must be a number, got the schedule Constant\(value=1\): a "
                                         r"schedule's numbers are fixed \(run schedules one after another with "
                                         r"optim\.Join\)"):
        optim.Linear(optim.Constant(1.0), 0.0, 10)
    with pytest.raises(TypeError, match=r"Piecewise: values\[1\] must be a number, got the schedule"):
        optim.Piecewise((5,), (1.0, optim.Cosine(1.0, 10)))
    with pytest.raises(TypeError, match=r"Exponential: rate must be a number, got the schedule"):
        optim.Exponential(1.0, optim.Constant(0.5), 10)


INF = float("inf")
BOUNDS = [
    (optim.Constant(0.3), (0.3, 0.3)),
    (optim.Linear(0.1, -0.1, 10), (-0.1, 0.1)),
    (optim.Cosine(1.0, 10, 0.1), (0.1, 1.0)),
    (optim.Piecewise((5, 10), (1.0, 3.0, 2.0)), (1.0, 3.0)),
    (optim.Join((optim.Linear(0.0, 1.0, 10), optim.Cosine(1.0, 90)), (10,)), (0.0, 1.0)),
    (optim.warmup_cosine(1.0, 10, 110, init=0.1, final=0.05), (0.05, 1.0)),
    (optim.WSD(1.0, 10, 20, 10, final=0.1), (0.0, 1.0)),        # the warmup starts at 0
    (optim.WSD(1.0, 0, 5, 4, final=0.5, shape="cosine"), (0.5, 1.0)),
    (optim.InvSqrt(2.0, 4), (0.0, 2.0)),
    (optim.Exponential(1.0, 0.5, 10), (0.0, 1.0)),             # tends to 0: counted as reached
    (optim.Exponential(0.5, 2.0, 10, staircase=True), (0.5, INF)),
    (optim.Exponential(-1.0, 0.5, 10), (-1.0, 0.0)),
    (optim.Polynomial(1.0, 0.2, 2, 10), (0.2, 1.0)),
]


@pytest.mark.parametrize("sched, bounds", BOUNDS, ids=[repr(b[0])[:40] for b in BOUNDS])
def test_schedule_bounds_are_its_range_over_all_steps(sched, bounds):
    """`bounds()` is what rules check a schedule against: every value lies in it, and its finite ends are
    reached (or approached)."""
    assert sched.bounds() == pytest.approx(bounds)
    values = np.asarray(jax.vmap(sched)(jnp.concatenate([jnp.arange(400), jnp.array([10_000])])))
    lo, hi = bounds
    assert np.all(values >= lo - 1e-6) and np.all(values <= hi + 1e-6)
    assert values.min() == pytest.approx(lo, abs=1e-3)
    assert hi == INF or values.max() == pytest.approx(hi, abs=1e-6)


def test_schedule_with_traced_numbers_has_unknown_bounds_and_is_not_checked():
    def f(peak):
        s = optim.Linear(peak, -peak, 10)
        assert s.bounds() is None
        return optim.Adam(s).lr(0)          # not refused: the value is not known here
    assert float(jax.jit(f)(0.1)) == pytest.approx(0.1)


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
    (optim.WSD(1, 0, 2, 10, final=1), optim.WSD(0.5, 0, 2, 10)),
    (optim.Exponential(1, 1, 10), optim.Exponential(0.5, 0.5, 10)),
    (optim.Polynomial(1, 1, 1, 10), optim.Polynomial(0.5, 0, 2, 10)),
], ids=["Linear", "Cosine", "Constant", "Piecewise", "warmup_cosine", "WSD", "Exponential", "Polynomial"])
def test_int_schedule_adjusted_to_floats_is_not_truncated(sched, half):
    assert all(np.isfinite([float(sched(jnp.int32(t))) for t in range(14)]))
    state = optim.setup(optim.Descent(sched), {"w": jnp.ones(1)})
    adjusted = optim.adjust(state, lr=half)
    got = float(optim.update(adjusted, {"w": jnp.zeros(1)}, {"w": jnp.ones(1)})[1]["w"][0])
    assert got == pytest.approx(-0.5, rel=1e-6)


# ----------------------------------------------------------------------------------------- WSD, InvSqrt, Exponential,
# Polynomial: exact values against numpy formulas written out here and against optax where it has the same schedule
def _values(sched, steps):
    """`sched` at each step, eagerly and jitted (float32)."""
    eager = np.array([float(sched(jnp.int32(t))) for t in steps])
    jitted = np.asarray(jax.jit(jax.vmap(sched))(jnp.asarray(steps, jnp.int32)))
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-7)
    return eager


def _wsd_numpy(peak, warmup, stable, decay, final, shape, t):
    t = np.asarray(t, np.float64)
    frac = np.clip((t - warmup - stable) / decay, 0, 1)
    down = {"linear": peak + (final - peak) * frac,
            "cosine": final + (peak - final) * (1 + np.cos(np.pi * frac)) / 2,
            "1-sqrt": final + (peak - final) * (1 - np.sqrt(frac))}[shape]
    return np.where(t < warmup, peak * t / max(warmup, 1), down)


def _boundary_steps(*ends):
    """0..max(ends)+5, which includes every boundary, the step before it and the steps after the end."""
    return list(range(0, max(ends) + 6))


WSD_CASES = [(2e-3, 10, 20, 15, 1e-5), (1.0, 0, 5, 8, 0.1), (1.0, 4, 0, 8, 0.0), (1.0, 0, 0, 1, 0.5),
             (0.5, 3, 2, 6, 1.0)]   # the last one decays upwards


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize("peak, warmup, stable, decay, final", WSD_CASES)
def test_wsd_values_match_the_formula(peak, warmup, stable, decay, final, shape):
    steps = _boundary_steps(warmup + stable + decay)
    got = _values(optim.WSD(peak, warmup, stable, decay, final=final, shape=shape), steps)
    np.testing.assert_allclose(got, _wsd_numpy(peak, warmup, stable, decay, final, shape, steps),
                               rtol=1e-6, atol=1e-6 * peak)
    assert got[0] == (0.0 if warmup else peak)                           # the warmup rises from 0
    assert got[warmup] == pytest.approx(peak, rel=1e-6)                  # reaches peak at step warmup
    assert got[warmup + stable] == pytest.approx(peak, rel=1e-6)         # decay starts from peak
    assert got[warmup + stable + decay] == pytest.approx(final, rel=1e-6, abs=1e-7)
    assert got[-1] == pytest.approx(final, rel=1e-6, abs=1e-7)          # then final


@pytest.mark.parametrize("shape", ["linear", "cosine"])
@pytest.mark.parametrize("peak, warmup, stable, decay, final", WSD_CASES)
def test_wsd_matches_optax_joined_pieces(peak, warmup, stable, decay, final, shape):
    if shape == "linear":
        down = optax.linear_schedule(peak, final, decay)
    else:
        down = optax.cosine_decay_schedule(peak, decay, alpha=final / peak)
    ref = optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak), down],
                               [warmup, warmup + stable])
    steps = _boundary_steps(warmup + stable + decay)
    got = _values(optim.WSD(peak, warmup, stable, decay, final=final, shape=shape), steps)
    np.testing.assert_allclose(got, [float(ref(t)) for t in steps], rtol=1e-6, atol=1e-6 * peak)


@pytest.mark.parametrize("peak, warmup", [(1.0, 1), (3e-4, 4), (2.0, 100)])
def test_inv_sqrt_matches_the_formula_and_optax_warmup(peak, warmup):
    steps = sorted(set(range(0, 2 * warmup + 3)) | {warmup - 1, 4 * warmup, 100 * warmup, 10**6})
    got = _values(optim.InvSqrt(peak, warmup), steps)
    t = np.asarray(steps, np.float64)
    want = np.where(t < warmup, peak * t / warmup, peak * np.sqrt(warmup / np.maximum(t, 1)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * peak)
    warm = optax.linear_schedule(0.0, peak, warmup)
    np.testing.assert_allclose(got[:warmup + 1], [float(warm(s)) for s in range(warmup + 1)], rtol=1e-6)
    assert got[0] == 0.0 and got[warmup] == pytest.approx(peak, rel=1e-6)
    assert got[steps.index(4 * warmup)] == pytest.approx(peak / 2, rel=1e-6)


@pytest.mark.parametrize("staircase", [False, True])
@pytest.mark.parametrize("init, rate, steps", [(1e-3, 0.5, 10), (1.0, 0.96, 7), (0.1, 1.5, 4), (2.0, 0.1, 1)])
def test_exponential_matches_optax_exponential_decay(init, rate, steps, staircase):
    ts = list(range(0, 4 * steps + 3))
    got = _values(optim.Exponential(init, rate, steps, staircase=staircase), ts)
    ref = optax.exponential_decay(init, steps, rate, staircase=staircase)
    np.testing.assert_allclose(got, [float(ref(t)) for t in ts], rtol=1e-6)
    p = np.asarray(ts, np.float64) / steps
    np.testing.assert_allclose(got, init * rate ** (np.floor(p) if staircase else p), rtol=1e-6)
    assert got[0] == pytest.approx(init, rel=1e-6) and got[steps] == pytest.approx(init * rate, rel=1e-6)


@pytest.mark.parametrize("init, end, power, steps", [
    (1.0, 0.0, 1, 10), (1e-2, 1e-4, 2, 25), (1.0, 0.1, 0.5, 8), (0.1, 1.0, 3, 5), (1.0, 0.0, 1.7, 1)])
def test_polynomial_matches_optax_polynomial_schedule(init, end, power, steps):
    ts = _boundary_steps(steps)
    got = _values(optim.Polynomial(init, end, power, steps), ts)
    ref = optax.polynomial_schedule(init, end, power, steps)
    np.testing.assert_allclose(got, [float(ref(t)) for t in ts], rtol=1e-6, atol=1e-7)
    t = np.asarray(ts, np.float64)
    np.testing.assert_allclose(got, (init - end) * (1 - np.minimum(t, steps) / steps) ** power + end,
                               rtol=1e-6, atol=1e-7)
    assert got[0] == pytest.approx(init, rel=1e-6) and got[steps] == got[-1] == pytest.approx(end, rel=1e-6)


def test_polynomial_with_power_one_is_linear():
    ts = list(range(15))
    np.testing.assert_allclose(_values(optim.Polynomial(1.0, 0.2, 1, 10), ts),
                               _values(optim.Linear(1.0, 0.2, 10), ts), rtol=1e-6)


@pytest.mark.parametrize("make, err, match", [
    (lambda: optim.WSD(1.0, -1, 0, 10), ValueError, "WSD: warmup must be >= 0"),
    (lambda: optim.WSD(1.0, 0, -1, 10), ValueError, "WSD: stable must be >= 0"),
    (lambda: optim.WSD(1.0, 10, 10, 0), ValueError, r"WSD: decay must be > 0 \(the schedule divides by it\)"),
    (lambda: optim.WSD(1.0, 10, 10, -3), ValueError, "WSD: decay must be > 0"),
    (lambda: optim.WSD(1.0, float("inf"), 10, 3), ValueError, "WSD: warmup must be >= 0 and finite"),
    (lambda: optim.WSD(float("inf"), 1, 1, 1), ValueError, "WSD: peak must be a number and finite"),
    (lambda: optim.WSD(1.0, 1, 1, 1, final=float("nan")), ValueError, "WSD: final must be a number and finite"),
    (lambda: optim.WSD("1e-3", 1, 1, 1), TypeError, "WSD: peak must be a real number"),
    (lambda: optim.WSD(1.0, "10", 1, 1), TypeError, "WSD: warmup must be a number of steps"),
    (lambda: optim.WSD(1.0, 1, 1, 1, shape="exp"), ValueError,
     "WSD: shape must be one of 'linear', 'cosine', '1-sqrt', got 'exp'"),
    (lambda: optim.WSD(1.0, 1, 1, 1, shape=None), ValueError, "WSD: shape must be one of"),
    (lambda: optim.InvSqrt(1.0, 0), ValueError, r"InvSqrt: warmup must be > 0 \(the schedule divides by it\)"),
    (lambda: optim.InvSqrt(1.0, -4), ValueError, "InvSqrt: warmup must be > 0"),
    (lambda: optim.InvSqrt(float("nan"), 4), ValueError, "InvSqrt: peak must be a number and finite"),
    (lambda: optim.Exponential(1.0, 0, 10), ValueError, "Exponential: rate must be > 0 and finite, got 0.0"),
    (lambda: optim.Exponential(1.0, -0.5, 10), ValueError, "Exponential: rate must be > 0"),
    (lambda: optim.Exponential(1.0, float("inf"), 10), ValueError, "Exponential: rate must be > 0 and finite"),
    (lambda: optim.Exponential(float("inf"), 0.5, 10), ValueError, "Exponential: init must be a number and finite"),
    (lambda: optim.Exponential(1.0, 0.5, 0), ValueError, r"Exponential: steps must be > 0 \(the schedule divides"),
    (lambda: optim.Exponential(1.0, 0.5, -1), ValueError, "Exponential: steps must be > 0"),
    (lambda: optim.Exponential(1.0, 0.5, 10, staircase=1), TypeError, "Exponential: staircase must be True or False"),
    (lambda: optim.Polynomial(1.0, 0.0, 0, 10), ValueError, "Polynomial: power must be > 0 and finite, got 0.0"),
    (lambda: optim.Polynomial(1.0, 0.0, -1, 10), ValueError, "Polynomial: power must be > 0"),
    (lambda: optim.Polynomial(1.0, 0.0, float("inf"), 10), ValueError, "Polynomial: power must be > 0 and finite"),
    (lambda: optim.Polynomial(1.0, float("nan"), 1, 10), ValueError, "Polynomial: end must be a number and finite"),
    (lambda: optim.Polynomial(1.0, 0.0, 1, 0), ValueError, r"Polynomial: steps must be > 0 \(the schedule divides"),
    (lambda: optim.Polynomial(1.0, 0.0, 1, -10), ValueError, "Polynomial: steps must be > 0"),
    (lambda: optim.Polynomial(1.0, 0.0, "2", 10), TypeError, "Polynomial: power must be a real number"),
])
def test_new_schedules_refuse_bad_arguments_at_construction(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_new_schedules_store_values_as_floats_and_lengths_as_given():
    w = optim.WSD(1, 10, 20, 30, final=0)
    assert (w.peak, w.final) == (1.0, 0.0) and all(type(v) is float for v in (w.peak, w.final))
    assert (w.warmup, w.stable, w.decay) == (10, 20, 30) and w.shape == "linear"
    assert type(optim.InvSqrt(2, 4).peak) is float
    e = optim.Exponential(1, 2, 10)
    assert type(e.init) is float and type(e.rate) is float and e.steps == 10
    p = optim.Polynomial(1, 0, 2, 10)
    assert all(type(v) is float for v in (p.init, p.end, p.power))
    assert repr(w) == "WSD(peak=1, warmup=10, stable=20, decay=30, final=0, shape='linear')"


def test_wsd_shape_is_structure_and_numbers_are_leaves():
    a = optim.WSD(1.0, 10, 20, 30)
    assert len(jax.tree.leaves(a)) == 5
    assert jax.tree.structure(a) == jax.tree.structure(optim.WSD(2.0, 1, 2, 3, final=0.5))
    assert jax.tree.structure(a) != jax.tree.structure(optim.WSD(1.0, 10, 20, 30, shape="cosine"))
    assert jax.tree.structure(optim.Exponential(1.0, 0.5, 3)) != \
        jax.tree.structure(optim.Exponential(1.0, 0.5, 3, staircase=True))


def test_new_schedules_with_traced_degenerate_lengths_never_give_nan():
    # Lengths that arrive traced cannot be checked at construction; the formulas still never divide by 0.
    ts = jnp.arange(0, 12, dtype=jnp.int32)
    cases = {
        "wsd-decay": (lambda n, t: optim.WSD(1.0, 2, 3, n, final=0.25)(t),
                      lambda n: [0.0, 0.5] + [1.0] * 3 + [0.25] * 7),
        "wsd-warmup": (lambda n, t: optim.WSD(1.0, n, 0, 4, final=0.0)(t), None),
        "wsd-stable": (lambda n, t: optim.WSD(1.0, 0, n, 4, final=0.0)(t), None),
        "wsd-cosine": (lambda n, t: optim.WSD(1.0, n, n, n, shape="cosine")(t), None),
        "wsd-1-sqrt": (lambda n, t: optim.WSD(1.0, n, n, n, shape="1-sqrt")(t), None),
        "inv-sqrt": (lambda n, t: optim.InvSqrt(1.0, n)(t), lambda n: [1.0] + [0.0] * 11),
        "exponential": (lambda n, t: optim.Exponential(0.5, 0.1, n)(t), lambda n: [0.5] * 12),
        "staircase": (lambda n, t: optim.Exponential(0.5, 0.1, n, staircase=True)(t), lambda n: [0.5] * 12),
        "polynomial": (lambda n, t: optim.Polynomial(1.0, 0.25, 2, n)(t), lambda n: [0.25] * 12),
    }
    for name, (f, want) in cases.items():
        g = jax.jit(jax.vmap(f, in_axes=(None, 0)))
        for n in (0, -3):
            got = np.asarray(g(jnp.int32(n), ts))
            assert np.all(np.isfinite(got)), (name, n, got)
            if want is not None:
                np.testing.assert_allclose(got, want(n), rtol=1e-6, err_msg=f"{name} n={n}")


def test_polynomial_with_traced_power_at_most_zero_stays_finite():
    f = jax.jit(jax.vmap(lambda p, t: optim.Polynomial(1.0, 0.25, p, 4)(t), in_axes=(None, 0)))
    for p in (0.0, -1.0):
        got = np.asarray(f(jnp.float32(p), jnp.arange(8)))
        assert np.all(np.isfinite(got)) and got[-1] == 0.25


def _trace_counted_step(grads):
    traces = []

    def step(state, model):
        traces.append(1)
        return optim.update(state, model, grads)

    return jax.jit(step), traces


@pytest.mark.parametrize("sched, other, changed", [
    (optim.WSD(1.0, 2, 3, 4, final=0.1), optim.WSD(0.5, 1, 2, 8, final=0.0), optim.WSD(0.5, 1, 2, 8, shape="cosine")),
    (optim.WSD(1.0, 2, 3, 4, shape="1-sqrt"), optim.WSD(2.0, 0, 1, 3, shape="1-sqrt"), optim.WSD(2.0, 0, 1, 3)),
    (optim.InvSqrt(1.0, 3), optim.InvSqrt(0.5, 2), None),
    (optim.Exponential(1.0, 0.5, 4), optim.Exponential(2.0, 0.9, 3), optim.Exponential(2.0, 0.9, 3, staircase=True)),
    (optim.Polynomial(1.0, 0.0, 2, 6), optim.Polynomial(0.5, 0.1, 0.5, 9), None),
], ids=["WSD-linear", "WSD-1-sqrt", "InvSqrt", "Exponential", "Polynomial"])
def test_new_schedule_in_a_jitted_rule_steps_with_the_counter_and_adjusts_without_retracing(sched, other, changed):
    g = {"x": jnp.ones(1)}
    m = {"x": jnp.zeros(1)}
    step, traces = _trace_counted_step(g)
    state = optim.setup(optim.Descent(sched), m)
    expect = 0.0
    for t in range(8):
        state, m = step(state, m)
        expect -= float(sched(t))
        np.testing.assert_allclose(m["x"], [expect], rtol=1e-6)
    state = optim.adjust(state, lr=other)                  # same kind (and shape): data only
    for t in range(8, 16):
        state, m = step(state, m)
        expect -= float(other(t))
        np.testing.assert_allclose(m["x"], [expect], rtol=1e-6)
    assert len(traces) == 1 and int(state.step) == 16
    if changed is not None:                                # a structural change retraces and still steps right
        state = optim.adjust(state, lr=changed)
        state, m = step(state, m)
        assert len(traces) == 2
        np.testing.assert_allclose(m["x"], [expect - float(changed(16))], rtol=1e-6)


def test_new_schedules_as_other_hyperparameters_in_a_chain():
    # weight decay and momentum as schedules, adjusted later through their own names; a numpy loop as reference
    wd, rho, lr = optim.Exponential(0.5, 0.5, 2), optim.Polynomial(0.9, 0.0, 1, 4), optim.InvSqrt(0.1, 2)
    rule = optim.chain(optim.WeightDecay(wd), optim.Momentum(lr, rho=rho))
    x0 = jnp.array([1.0, -2.0])
    step, traces = _trace_counted_step({"x": jnp.array([0.5, 0.25])})
    state, m = optim.setup(rule, {"x": x0}), {"x": x0}
    x, v = np.asarray(x0, np.float64), np.zeros(2)
    for t in range(10):
        if t == 5:
            wd, rho = optim.Exponential(0.2, 0.9, 3), optim.Polynomial(0.5, 0.1, 2, 8)
            state = optim.adjust(state, weight_decay=wd, rho=rho)
        state, m = step(state, m)
        gt = np.array([0.5, 0.25]) + float(wd(t)) * x
        v = float(rho(t)) * v + float(lr(t)) * gt
        x = x - v
        np.testing.assert_allclose(m["x"], x, rtol=1e-5, atol=1e-7)
    assert len(traces) == 1


def test_adamw_with_wsd_matches_optax_over_30_steps():
    peak, warmup, stable, decay, final = 1e-2, 5, 10, 10, 1e-4
    sched_o = optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak),
                                    optax.cosine_decay_schedule(peak, decay, alpha=final / peak)],
                                   [warmup, warmup + stable])
    sched = optim.WSD(peak, warmup, stable, decay, final=final, shape="cosine")
    _adamw_matches_optax(sched, sched_o, seed=1, steps=30)


# ------------------------------------------------------------------------------ a schedule where init reads it
def _constant_fields(rule):
    """`rule` with each hyperparameter (a number, or each number of a tuple of them) replaced by a `Constant` of
    it, except those only `init` reads; and the names replaced."""
    import dataclasses
    cls, changes = type(rule), {}
    for f in dataclasses.fields(rule):
        v = getattr(rule, f.name)
        if f.name in cls._static + cls._counts + cls._steps + cls._initial:
            continue
        if isinstance(v, float):
            changes[f.name] = optim.Constant(v)
        elif isinstance(v, tuple) and v and all(isinstance(a, float) for a in v):
            changes[f.name] = tuple(optim.Constant(a) for a in v)
    return dataclasses.replace(rule, **changes), sorted(changes)


def _defaults():
    from rule_cases import RULES
    return [(r.cls.__name__, r.default) for r in RULES if r.default is not None and not r.cls._initial]


def _matrices_only() -> set:
    """The rules the registry steps on matrices only (its `matrices` cases: Muon, NorMuon)."""
    from rule_cases import RULES
    return {r.cls.__name__ for r in RULES if r.matrices}


@pytest.mark.parametrize("name, rule", _defaults(), ids=[n for n, _ in _defaults()])
def test_every_hyperparameter_may_be_a_schedule_also_where_init_reads_it(name, rule):
    """A `Constant` in place of each number of a rule's defaults (AMSGrad's ε starts its moments, AdaGrad's its
    accumulator: `init` reads the schedule's value at step 0) steps exactly as the numbers do."""
    sched, names = _constant_fields(rule)
    if not names:
        pytest.skip(f"{name} has no hyperparameter to schedule")
    key = jax.random.key(0)
    model = {"w": jax.random.normal(key, (6, 5)), "v": jnp.linspace(-1.0, 1.0, 5)}
    if name in ("SOAP", "Lars") or name in _matrices_only():
        model = {"w": model["w"]}
    got = []
    for r in (rule, sched):
        s, m = optim.setup(r, model), model
        for t in range(3):
            g = jax.tree.map(lambda a, t=t: jnp.cos(a * (t + 2.0)), m)
            s, m = optim.update(s, m, g)
        got.append(m)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name}: {names}")


def test_a_schedule_for_eps_starts_amsgrad_and_adagrad_at_its_step_0_value():
    """AMSGrad's moments and AdaGrad's accumulator start at ε: with a schedule, its value at step 0; the steps
    then read the schedule at each step."""
    x = {"x": jnp.array([1.0, -2.0])}
    s = optim.setup(optim.AMSGrad(0.1, eps=optim.Linear(1e-3, 1e-1, 10)), x)
    np.testing.assert_array_equal(np.asarray(s["x"].state.mu), np.float32(1e-3))
    s = optim.setup(optim.AdaGrad(0.1, eps=optim.Linear(0.5, 1.5, 2)), x)
    np.testing.assert_array_equal(np.asarray(s["x"].state), np.float32(0.5))
    acc = np.full(2, 0.5, np.float32)
    xs = np.asarray(x["x"])
    for t, e in enumerate((0.5, 1.0, 1.5)):
        g = np.array([0.5, -1.0], np.float32)
        s, x = optim.update(s, x, {"x": jnp.asarray(g)})
        acc = acc + g * g
        xs = xs - g * np.float32(0.1) / (np.sqrt(acc) + np.float32(e))
    np.testing.assert_allclose(np.asarray(x["x"]), xs, rtol=1e-6)


def test_a_schedule_for_a_value_only_init_reads_is_refused_by_name():
    """Rprop's `lr` is its initial step size, read once by `init`: a schedule is refused at construction (and
    in `adjust`), naming the field, before anything is set up."""
    with pytest.raises(TypeError, match=r"^Rprop: lr is read once, by init, so a schedule's values after step 0 "):
        optim.Rprop(lr=optim.Constant(1e-3))
    s = optim.setup(optim.Rprop(0.1), jnp.ones(3))
    with pytest.raises(TypeError, match=r"Rprop: lr is read once, by init"):
        optim.adjust(s, lr=optim.Linear(0.1, 0.0, 10))
    assert "lr" in optim.Rprop._initial and "lr" in optim.Rprop._nonneg
