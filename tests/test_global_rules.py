"""Whole-model rules (ClipGlobalNorm, SkipNonFinite) and per-leaf rule choice (`setup` with a function)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from conftest import close


def test_clip_global_norm_exact():
    m = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
    state = optim.setup(optim.chain(optim.ClipGlobalNorm(1.0), optim.Descent(1.0)), m)
    _, out = optim.update(state, m, {"a": jnp.array([3.0]), "b": jnp.array([4.0])})
    close(out["a"], [-0.6])
    close(out["b"], [-0.8])
    _, out = optim.update(state, m, {"a": jnp.array([0.3]), "b": jnp.array([0.4])})   # below the bound
    close(out["b"], [-0.4])
    _, out = optim.update(state, m, {"a": jnp.array([3.0]), "b": None})               # None does not count
    close(out["a"], [-1.0])


def test_clip_global_norm_counts_a_tie_once_unlike_optax():
    w = jnp.zeros(2)
    m = {"enc": w, "dec": w}
    g = {"enc": jnp.array([3.0, 4.0]), "dec": jnp.array([3.0, 4.0])}
    state = optim.setup(optim.chain(optim.ClipGlobalNorm(1.0), optim.Descent(1.0)), m)
    _, out = optim.update(state, m, g)
    close(out["enc"], [-0.6, -0.8])               # the summed gradient [6, 8] has norm 10
    assert float(optim.global_norm(g, state)) == pytest.approx(10.0)
    assert float(optax.global_norm(g)) == pytest.approx(np.sqrt(50.0))   # optax counts the tie twice
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    u, _ = tx.update(g, tx.init(m), m)
    summed_optax_step = np.asarray(u["enc"] + u["dec"])
    assert not np.allclose(summed_optax_step, [-0.6, -0.8])


def test_clip_global_norm_inside_jit_and_after_a_per_leaf_stage():
    m = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
    rule = optim.chain(optim.ClipGrad(3.0), optim.ClipGlobalNorm(1.0), optim.Descent(1.0))
    state = optim.setup(rule, m)
    _, out = jax.jit(optim.update)(state, m, {"a": jnp.array([30.0]), "b": jnp.array([4.0])})
    close(out["a"], [-0.5 ** 0.5])                # clipped to (3, 3) first, then to norm 1
    close(out["b"], [-0.5 ** 0.5])


def test_skip_non_finite_leaves_everything_untouched_and_counts():
    m = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])}
    state = optim.setup(optim.SkipNonFinite(optim.Adam(0.1)), m)
    good = {"a": jnp.array([1.0, 1.0]), "b": jnp.array([1.0])}
    bad = {"a": jnp.array([1.0, jnp.nan]), "b": jnp.array([1.0])}
    for step in (optim.update, jax.jit(optim.update)):
        s1, m1 = step(state, m, bad)
        close(m1["a"], m["a"])
        close(m1["b"], m["b"])
        assert int(s1["b"].state[1]) == 1 and int(s1["a"].state[1]) == 1
        jax.tree.map(close, s1["a"].state[0], state["a"].state[0])
        s2, m2 = step(s1, m1, good)
        _, ref = optim.update(optim.setup(optim.Adam(0.1), m), m, good)
        close(m2["a"], ref["a"])
        assert int(s2["a"].state[1]) == 1
    s3, m3 = optim.update(state, m, {"a": jnp.array([1.0, jnp.inf]), "b": None})
    close(m3["a"], m["a"])


def test_rule_per_leaf_and_tie_groups():
    model = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    state = optim.setup(lambda path, x: optim.Muon(0.02) if x.ndim == 2 else optim.AdamW(3e-4), model)
    assert isinstance(state["w"].rule, optim.Muon) and isinstance(state["b"].rule, optim.AdamW)
    assert len(state.rules) == 2
    same = optim.setup(lambda path, x: optim.AdamW(3e-4), model)
    assert len(same.rules) == 1                     # equal rules are shared: one group of hyperparameters
    w = jnp.ones(2)
    with pytest.raises(ValueError, match="'a' and 'b' are tied .* different rules"):
        optim.setup(lambda path, x: optim.Descent(0.1 if path == "a" else 0.2), {"a": w, "b": w})
    with pytest.raises(TypeError, match="returned 3 for 'a'"):
        optim.setup(lambda path, x: 3, {"a": w})
    s = optim.adjust(state, lr=1e-3)
    assert float(s["w"].rule.lr) == pytest.approx(1e-3) and float(s["b"].rule.lr) == pytest.approx(1e-3)
    g = jax.tree.map(jnp.ones_like, model)
    _, out = optim.update(state, model, g)
    # each leaf takes its own rule's step: what that rule alone gives on that leaf
    _, muon_alone = optim.update(optim.setup(optim.Muon(0.02), {"w": model["w"]}), {"w": model["w"]}, {"w": g["w"]})
    close(out["w"], muon_alone["w"])
    assert not np.allclose(out["w"], model["w"])
    close(out["b"], [-3e-4, -3e-4], rtol=1e-5, atol=0)   # AdamW's first step is lr * sign(g)
