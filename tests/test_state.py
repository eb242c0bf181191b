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
