"""Adafactor (optim/_rules/adafactor.py): against optax.adafactor in float64, factored and unfactored, stacked, and
its per-parameter counts, structural fields and errors.

optax is the reference for the formulas: its `decay_rate_fn` computes ρ in float32 even under x64 (a relative
difference of ~1e-9 after 30 steps), hence rtol 1e-6 (the issue's bound) with an atol of 1e-9 times the scale.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from conftest import close

STEPS = 30
# (256, 128): factored (both dims >= 128); (128, 300): factored, largest axis last; (130, 4, 140): 3-D, factored
# over its two largest axes; (64, 64): below the threshold, unfactored; (7,) and (): vectors and scalars.
SHAPES = {"emb": (256, 128), "w2": (128, 300), "conv": (130, 4, 140), "small": (64, 64), "b": (7,), "s": ()}

def adafactor64(learning_rate, min_dim_size_to_factor=128, decay_rate=0.8, decay_offset=0,
                multiply_by_parameter_scale=True, clipping_threshold=1.0, momentum=None, dtype_momentum=jnp.float32,
                weight_decay_rate=None, eps=1e-30, factored=True):
    """`optax.adafactor` as optax composes it, with the decay ρ computed in float64 (optax's default
    `decay_rate_fn` computes it in float32 even under x64: `test_matches_optax_adafactor_alias` compares with
    it)."""
    def rho(i, exponent):
        return 1.0 - jnp.asarray(i + 1, jnp.float64) ** -exponent

    tx = [optax.scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps, rho)]
    if clipping_threshold is not None:
        tx.append(optax.clip_by_block_rms(clipping_threshold))
    tx.append(optax.scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        tx.append(optax.scale_by_param_block_rms())
    if momentum is not None:
        tx.append(optax.ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        tx.append(optax.add_decayed_weights(weight_decay_rate))
    return optax.chain(*tx, optax.scale(-1))


CONFIGS = [
    ("defaults", dict(lr=0.05), dict(learning_rate=0.05)),
    ("momentum,wd,no clip", dict(lr=0.05, momentum=0.9, weight_decay=1e-3, clipping_threshold=None),
     dict(learning_rate=0.05, momentum=0.9, weight_decay_rate=1e-3, clipping_threshold=None,
          dtype_momentum=jnp.float64)),
    ("no param scale,min dim 32,decay .5,clip 2", dict(lr=0.01, multiply_by_parameter_scale=False,
                                                       min_dim_size_to_factor=32, decay_rate=0.5,
                                                       clipping_threshold=2.0, eps=1e-20),
     dict(learning_rate=0.01, multiply_by_parameter_scale=False, min_dim_size_to_factor=32, decay_rate=0.5,
          clipping_threshold=2.0, eps=1e-20)),
    ("unfactored", dict(lr=0.05, factored=False), dict(learning_rate=0.05, factored=False)),
]


def _model(rng):
    m = {k: jnp.asarray(rng.standard_normal(s)) for k, s in SHAPES.items()}
    m["head"] = m["emb"]                                   # tied: one parameter for optim
    return m


def _grads(rng):
    return {k: jnp.asarray(rng.standard_normal(SHAPES["emb" if k == "head" else k])) for k in (*SHAPES, "head")}


def _run(kw, tx, steps=STEPS, check=None):
    """Train the tied model with `Adafactor(**kw)` and the untied one with optax's `tx` (the gradient of the tie
    group summed), calling `check(t, model, p)` after every step."""
    rng = np.random.default_rng(0)
    model = _model(rng)
    state = optim.setup(optim.Adafactor(**kw), model)
    assert len(state.paths()) == len(SHAPES)                # emb and head: one parameter
    p = {k: model[k] for k in SHAPES}
    s = tx.init(p)

    @jax.jit
    def ostep(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(optim.update)
    for t in range(steps):
        g = _grads(rng)
        state, model = step(state, model, g)
        p, s = ostep(p, s, {**{k: g[k] for k in SHAPES}, "emb": g["emb"] + g["head"]})
        close(model["head"], model["emb"], rtol=0, atol=0)    # jit returns two buffers, equal
        check(t, model, p)
    return model, p


@pytest.mark.parametrize("name, kw, optax_kw", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_matches_optax_adafactor_float64(name, kw, optax_kw):
    """Every step of every parameter to rtol 1e-10 against optax's composition (ρ in float64), and the moved
    distance too, so that small steps are not hidden in the parameter's size."""
    start = _model(np.random.default_rng(0))

    def check(t, model, p):
        for k in SHAPES:
            assert model[k].dtype == jnp.float64
            msg = f"{name}: step {t + 1}, {k}"
            close(model[k], p[k], rtol=1e-10, atol=1e-14, err_msg=msg)
            close(model[k] - start[k], p[k] - start[k], rtol=1e-9, atol=1e-14, err_msg=msg)

    with jax.enable_x64(True):
        _run(kw, adafactor64(**optax_kw), check=check)


@pytest.mark.parametrize("name, kw, optax_kw", CONFIGS[1:2], ids=[c[0] for c in CONFIGS[1:2]])
def test_matches_optax_adafactor_alias(name, kw, optax_kw):
    """Against `optax.adafactor` itself over 30 steps: rtol 1e-6, and an atol of 1e-8 of the parameter's scale
    for the entries where its float32 ρ (a relative 1e-8 per step) shows in a small step."""
    def check(t, model, p):
        for k in SHAPES:
            scale = float(jnp.max(jnp.abs(p[k])))
            close(model[k], p[k], rtol=1e-6, atol=1e-8 * scale, err_msg=f"{name}: step {t + 1}, {k}")

    with jax.enable_x64(True):
        _run(kw, optax.adafactor(**optax_kw), check=check)


def test_state_is_factored_and_sublinear():
    model = {"a": jnp.ones((256, 128)), "b": jnp.ones((128, 300)), "c": jnp.ones((130, 4, 140)),
             "d": jnp.ones((64, 64)), "v": jnp.ones(5)}
    state = optim.setup(optim.Adafactor(), model)
    shapes = {k: jax.tree.map(jnp.shape, state[k].state) for k in model}
    assert shapes["a"] == {"count": (), "v_row": (128,), "v_col": (256,)}
    assert sum(a.size for a in jax.tree.leaves(state["a"].state)) == 256 + 128 + 1
    assert shapes["b"] == {"count": (), "v_row": (128,), "v_col": (300,)}
    assert shapes["c"] == {"count": (), "v_row": (130, 4), "v_col": (4, 140)}   # largest axis 2, then 0
    assert shapes["d"] == {"count": (), "v": (64, 64)}     # 64 < min_dim_size_to_factor
    assert shapes["v"] == {"count": (), "v": (5,)}
    # optax keeps the same numbers (plus placeholders of shape (1,) for the unused fields)
    o = optax.adafactor(0.01).init(model)[0]
    assert o.v_row["a"].shape == (128,) and o.v_col["a"].shape == (256,) and o.v["d"].shape == (64, 64)
    assert o.v_row["c"].shape == (130, 4) and o.v_col["c"].shape == (4, 140)


def test_stacked_factored_state_stays_factored_and_matches_per_leaf():
    """Same-shaped matrices share a stack; the stack's state is a stack of row and column statistics, and every
    member steps as it would alone (optax runs each leaf alone)."""
    rng = np.random.default_rng(3)
    model = {f"w{i}": jnp.asarray(rng.standard_normal((24, 16)), jnp.float32) for i in range(5)}
    model["v"] = jnp.asarray(rng.standard_normal(16), jnp.float32)
    rule = optim.Adafactor(0.05, min_dim_size_to_factor=8, momentum=0.5)
    state = optim.setup(rule, model)
    sizes = sorted(len(g) for g in state.layout.stacks)
    assert sizes == [1, 5]
    stack = next(i for i, g in enumerate(state.layout.stacks) if len(g) == 5)
    assert jax.tree.map(jnp.shape, state.stacks[stack]) == {"count": (5,), "m": (5, 24, 16), "v_row": (5, 16),
                                                            "v_col": (5, 24)}
    tx = optax.adafactor(0.05, min_dim_size_to_factor=8, momentum=0.5)
    p, s = dict(model), tx.init(model)
    for t in range(4):
        g = {k: jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for k, x in model.items()}
        state, model = optim.update(state, model, g)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        for k in model:
            close(model[k], p[k], rtol=2e-5, atol=1e-6, err_msg=f"step {t + 1}, {k}")


def test_none_gradient_keeps_that_parameters_count_and_statistics():
    rule = optim.Adafactor(0.1, min_dim_size_to_factor=2)
    model = {"a": jnp.ones((3, 2)), "b": jnp.full((3, 2), 2.0)}
    state = optim.setup(rule, model)
    g = {"a": jnp.ones((3, 2)), "b": jnp.full((3, 2), 0.5)}
    state, m = optim.update(state, model, {"a": g["a"], "b": None})
    assert int(state["a"].state["count"]) == 1 and int(state["b"].state["count"]) == 0
    assert m["b"] is model["b"]
    jax.tree.map(np.testing.assert_array_equal, state["b"].state, optim.setup(rule, model)["b"].state)
    state, m = optim.update(state, m, g)
    alone = optim.setup(rule, {"b": model["b"]})
    _, mb = optim.update(alone, {"b": model["b"]}, {"b": g["b"]})
    close(m["b"], mb["b"], rtol=0, atol=0)                  # b's first step, as if the skipped call never happened


def test_first_step_by_hand():
    """Step 1: ρ = 0, so V is G = g² + ε₁ (or its factors) and u = g / √V̂; here g is rank 1, so the factored
    estimate is exact: u = sign(g). Clipped to RMS 1, scaled by η and by RMS(x)."""
    x = jnp.full((4, 3), 2.0)
    g = jnp.asarray(np.outer([1.0, -2.0, 0.5, 3.0], [1.0, 2.0, -1.0]), jnp.float32)
    for kw in ({"min_dim_size_to_factor": 2}, {"factored": False}):
        state = optim.setup(optim.Adafactor(0.1, **kw), x)
        _, new = optim.update(state, x, g)
        close(new, x - 0.1 * 2.0 * np.sign(np.asarray(g)), rtol=1e-6)


def test_decay_offset_shifts_the_decay_schedule_as_optax():
    """optax's `decay_offset` subtracts from its global count; with counts advanced to 3 in both (a fine-tuning
    restart), offset 3 makes the next step ρ's first (ρ = 0: V is the new G alone)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        model = {"w": jnp.asarray(rng.standard_normal((6, 5)))}
        state = optim.setup(optim.Adafactor(0.05, decay_offset=3, min_dim_size_to_factor=4), model)
        tree = optim.state_dict(state)
        tree["params"]["w"]["count"] = jnp.asarray(3, jnp.int32)
        state = optim.load_state_dict(state, tree)
        tx = optax.adafactor(0.05, decay_offset=3, min_dim_size_to_factor=4)
        p, s = dict(model), tx.init(model)
        s = (s[0]._replace(count=jnp.asarray(3, jnp.int32)), *s[1:])
        for _ in range(5):
            g = {"w": jnp.asarray(rng.standard_normal((6, 5)))}
            state, model = optim.update(state, model, g)
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
            close(model["w"], p["w"], rtol=1e-6, atol=1e-12)


def test_sixteen_bit_parameters_compute_in_float32():
    x = {"w": jnp.full((4, 3), 0.5, jnp.bfloat16)}
    state = optim.setup(optim.Adafactor(0.1, min_dim_size_to_factor=2, momentum=0.9, mu_dtype=jnp.float32), x)
    assert state["w"].state["v_row"].dtype == jnp.bfloat16 and state["w"].state["m"].dtype == jnp.float32
    state, new = optim.update(state, x, {"w": jnp.full((4, 3), 1e-3, jnp.bfloat16)})
    assert new["w"].dtype == jnp.bfloat16
    # g² = 1e-6 is far below bfloat16's resolution near 1, but u = g / √(g²) = 1 in float32; step 0.1·0.1·0.5
    close(new["w"], np.full((4, 3), 0.5 - 0.005), rtol=1e-2)
    assert np.all(np.isfinite(np.asarray(state["w"].state["v_row"], np.float32)))


def test_momentum_none_and_structural_fields_are_refused_by_adjust():
    """(That adjusting Adafactor's numbers never retraces is in test_rules.test_adjust_new_rules_never_retraces.)"""
    state = optim.setup(optim.Adafactor(0.01, momentum=0.9, min_dim_size_to_factor=2), {"w": jnp.ones((4, 3))})
    with pytest.raises(ValueError, match=r"Adafactor.momentum: between None and a number is structural"):
        optim.adjust(state, momentum=None)
    for name in ("factored", "min_dim_size_to_factor", "multiply_by_parameter_scale", "mu_dtype"):
        with pytest.raises(ValueError, match=f"Adafactor.{name} is structural"):
            optim.adjust(state, **{name: None})


def test_defaults_are_optax_defaults():
    sig = inspect.signature(optax.adafactor).parameters
    r = optim.Adafactor()
    assert (r.decay_rate, r.decay_offset, r.clipping_threshold, r.momentum, r.eps, r.factored,
            r.min_dim_size_to_factor, r.multiply_by_parameter_scale) == tuple(
        sig[k].default for k in ("decay_rate", "decay_offset", "clipping_threshold", "momentum", "eps", "factored",
                                 "min_dim_size_to_factor", "multiply_by_parameter_scale"))
    assert sig["weight_decay_rate"].default is None and r.weight_decay == 0.0
    assert optim.Adafactor(clipping_threshold=None).clipping_threshold == float("inf")
    assert isinstance(optim.Adafactor(decay_offset=2).decay_offset, int)


BAD = [
    ("lr", lambda: optim.Adafactor(-0.1), ValueError, "Adafactor: lr must be >= 0 and finite, got -0.1"),
    ("decay_rate", lambda: optim.Adafactor(decay_rate=float("nan")), ValueError, "Adafactor: decay_rate must be"),
    ("decay_offset", lambda: optim.Adafactor(decay_offset=-1), ValueError, "Adafactor: decay_offset must be"),
    ("decay_offset float", lambda: optim.Adafactor(decay_offset=1.5), (TypeError, ValueError),
     "Adafactor: decay_offset must be"),
    ("momentum", lambda: optim.Adafactor(momentum=1.5), ValueError, r"Adafactor: momentum must be in \[0, 1\]"),
    ("clipping", lambda: optim.Adafactor(clipping_threshold=-1.0), ValueError, "clipping_threshold must be >= 0"),
    ("mu_dtype", lambda: optim.Adafactor(mu_dtype=jnp.int32), TypeError, "Adafactor: mu_dtype must be a real"),
    ("lr type", lambda: optim.Adafactor("0.1"), TypeError, "Adafactor: lr must be a real"),
    ("factored", lambda: optim.Adafactor(factored="no"), TypeError,
     "Adafactor: factored must be True or False, got str 'no'"),
    ("multiply_by_parameter_scale", lambda: optim.Adafactor(multiply_by_parameter_scale="no"), TypeError,
     "Adafactor: multiply_by_parameter_scale must be True or False, got str 'no'"),
    ("min_dim_size_to_factor", lambda: optim.Adafactor(min_dim_size_to_factor=-1), ValueError,
     r"Adafactor: min_dim_size_to_factor must be >= 0, got -1 \(it is the length"),
    ("min_dim_size_to_factor float", lambda: optim.Adafactor(min_dim_size_to_factor=2.0), TypeError,
     "Adafactor: min_dim_size_to_factor must be an integer, got float 2.0"),
    ("min_dim_size_to_factor bool", lambda: optim.Adafactor(min_dim_size_to_factor=True), TypeError,
     "Adafactor: min_dim_size_to_factor must be an integer, got bool"),
    ("lr schedule", lambda: optim.Adafactor(optim.Cosine(-0.01, 10)), ValueError,
     "Adafactor: lr must be >= 0 at every step"),
]


@pytest.mark.parametrize("name, make, err, match", BAD, ids=[c[0] for c in BAD])
def test_bad_hyperparameters_refused(name, make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_structural_arguments_in_range_are_kept_as_python_types():
    r = optim.Adafactor(factored=np.bool_(False), min_dim_size_to_factor=np.int32(0))
    assert r.factored is False and r.min_dim_size_to_factor == 0 and type(r.min_dim_size_to_factor) is int
    state = optim.setup(optim.Adafactor(min_dim_size_to_factor=0), {"w": jnp.ones((2, 3))})
    assert set(state["w"].state) == {"count", "v_row", "v_col"}          # 0: every matrix is factored


def test_save_load_and_state_dict_keep_the_named_state(tmp_path):
    model = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    grads = {"w": jnp.full((4, 3), 0.3), "b": jnp.array([1.0, -2.0, 0.5])}
    rule = optim.Adafactor(0.01, momentum=0.9, min_dim_size_to_factor=2)
    state, model = optim.update(optim.setup(rule, model), model, grads)
    optim.save(tmp_path / "s.optim", state)
    back = optim.load(tmp_path / "s.optim", optim.setup(rule, model))
    jax.tree.map(np.testing.assert_array_equal, back.stacks, state.stacks)
    tree = optim.state_dict(state)
    assert sorted(tree["params"]["w"]) == ["count", "m", "v_col", "v_row"] and int(tree["params"]["w"]["count"]) == 1
    again = optim.load_state_dict(optim.setup(rule, model), tree)
    jax.tree.map(np.testing.assert_array_equal, again.stacks, state.stacks)
    a, _ = optim.update(state, model, grads)
    b, _ = optim.update(again, model, grads)
    jax.tree.map(np.testing.assert_array_equal, a.stacks, b.stacks)


def test_learning_rate_is_the_one_default_that_differs_from_optax():
    """optax's `adafactor()` applies no learning rate (`learning_rate=None`, a factor of 1): it is
    `Adafactor(1.0)`, and not `Adafactor()`, whose η is 0.01 (float32, optax's own `decay_rate_fn`)."""
    assert inspect.signature(optax.adafactor).parameters["learning_rate"].default is None
    x = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.array([0.5, -2.0])}
    tx = optax.adafactor(min_dim_size_to_factor=2)
    p, s = x, tx.init(x)
    ours = {lr: optim.setup(optim.Adafactor(lr, min_dim_size_to_factor=2), x) for lr in (1.0, 0.01)}
    models = {lr: x for lr in ours}
    for t in range(5):
        g = jax.tree.map(lambda a: jnp.cos(a * (t + 1)), p)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        for lr in ours:
            ours[lr], models[lr] = optim.update(ours[lr], models[lr], jax.tree.map(lambda a: jnp.cos(a * (t + 1)),
                                                                                  models[lr]))
    for k in x:
        close(models[1.0][k], p[k], rtol=1e-5, atol=1e-6)
        assert not np.allclose(models[0.01][k], p[k], rtol=1e-3)
