"""State surgery: setup(like=), subtree, graft, reset, retie, donatable."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from conftest import close


def trained(model, rule=None):
    state = optim.setup(rule or optim.Momentum(0.1), model)
    state, model = optim.update(state, model, jax.tree.map(jnp.ones_like, model))
    return state, model


def test_setup_like_keeps_matching_state_and_starts_new_paths_fresh():
    old_model = {"enc": {"w": jnp.ones(3)}, "head": jnp.ones(2), "gone": jnp.ones(1)}
    state, _ = trained(old_model)
    new_model = {"enc": {"w": jnp.ones(3)}, "head": jnp.ones(4), "new": jnp.ones(2)}
    new = optim.setup(optim.Momentum(0.1), new_model, like=state)
    close(new["enc.w"].state, state["enc.w"].state)             # kept
    assert float(new["enc.w"].state[0]) != 0
    close(new["head"].state, np.zeros(4))                      # shape changed: fresh
    close(new["new"].state, np.zeros(2))                       # new path: fresh
    assert "gone" not in new
    other_rule = optim.setup(optim.Adam(), new_model, like=state)   # another state structure: fresh
    assert jax.tree.structure(other_rule["enc.w"].state) != jax.tree.structure(state["enc.w"].state)


def test_setup_like_recomputes_ties():
    w = jnp.ones(2)
    state, _ = trained({"a": w, "b": jnp.ones(2)})
    new = optim.setup(optim.Momentum(0.1), {"a": w, "b": w}, like=state)
    assert new.ties() == {"a": ("b",)}
    close(new["b"].state, state["a"].state)


def test_subtree_and_graft_round_trip():
    w = jnp.ones(2)
    model = {"enc": {"a": w, "b": jnp.ones(3)}, "head": w}
    state, model = trained(model)
    sub = optim.subtree(state, "enc")
    assert sub.paths() == ["a", "b"]
    close(sub["a"].state, state["head"].state)
    sub_model = model["enc"]
    sub2, sub_model2 = optim.update(sub, sub_model, jax.tree.map(jnp.ones_like, sub_model))
    full = optim.graft(state, "enc", sub2)
    close(full["enc.b"].state, sub2["b"].state)
    close(full["head"].state, sub2["a"].state)                  # the tie reaches outside: one state
    with pytest.raises(ValueError, match="'x' is not a node"):
        optim.subtree(state, "x")
    bad = optim.setup(optim.Adam(), model["enc"])
    with pytest.raises(ValueError, match="graft: the state for 'enc.a'"):
        optim.graft(state, "enc", bad)


def test_reset_zeroes_momenta():
    state, model = trained({"a": jnp.ones(2), "b": jnp.ones(2)}, optim.Adam(0.1))
    r = optim.reset(state, "a")
    close(r["a"].state[0], [0, 0])
    close(r["a"].state[2], [1, 1])              # the products of the β's of no step
    jax.tree.map(np.testing.assert_array_equal, r["b"].state, state["b"].state)
    assert float(r["b"].state[0][0]) != 0
    mp, m = trained({"a": jnp.ones(2, jnp.float16)}, optim.MixedPrecision(jnp.float32, optim.Adam(0.1)))
    with pytest.raises(ValueError, match="pass model="):
        optim.reset(mp)
    close(optim.reset(mp, model=m)["a"].state[0], m["a"].astype(jnp.float32))


def test_retie_after_a_jitted_step():
    w = jnp.ones(2)
    m = {"a": w, "b": w, "t": jnp.ones((2, 1))}
    state = optim.setup(optim.Descent(0.1), m, ties={"t": ("a", lambda x: x.reshape(2, 1))})
    g = {"a": jnp.ones(2), "b": jnp.ones(2), "t": jnp.ones((2, 1))}
    state, m2 = jax.jit(optim.update)(state, m, g)
    assert m2["a"] is not m2["b"]
    r = optim.retie(state, m2)
    assert r["a"] is r["b"] and len(optim.trainables(r)) == 2
    close(r["t"], np.asarray(r["a"]).reshape(2, 1))
    assert optim.setup(optim.Descent(0.1), r).ties() == {"a": ("b",)}
    with pytest.raises(ValueError, match="missing 'b'"):
        optim.retie(state, {"a": w, "t": w})


def test_donatable_lets_a_user_jit_donate_a_tied_model():
    w = jnp.ones((4, 4))
    model = {"emb": w, "head": w}
    state = optim.setup(optim.Adam(1e-3), model)

    def train_step(s, m, x):
        return optim.update(s, m, jax.grad(lambda m: jnp.sum((x @ m["emb"]) @ m["head"].T))(m))

    step = jax.jit(train_step, donate_argnums=(0, 1))
    m = optim.donatable(state, model)
    assert m["emb"] is not m["head"] and model["emb"] is model["head"]
    for _ in range(3):
        state, m = step(state, m, jnp.ones((2, 4)))
    np.testing.assert_array_equal(m["emb"], m["head"])
    ref_state, ref = optim.setup(optim.Adam(1e-3), model), model
    for _ in range(3):
        ref_state, ref = train_step(ref_state, ref, jnp.ones((2, 4)))
    close(m["emb"], ref["emb"])
