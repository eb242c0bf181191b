"""trainables and destructure: each tied array once; rebuild is differentiable and restores ties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim


def test_trainables_unique_in_flatten_order():
    s = jnp.ones(2)
    model = {"x": s, "y": s, "z": jnp.zeros(4), "n": 3, "i": jnp.arange(3)}
    ts = optim.trainables(model)
    assert len(ts) == 2 and ts[0] is s
    assert [p for p, _ in optim.trainables(model, path=True)] == ["x", "z"]


def test_destructure_length_and_ties_restored():
    s = jnp.array([1.0, 2.0])
    model = {"x": s, "y": s, "z": jnp.array([3.0, 4.0, 5.0, 6.0]), "f": "keep"}
    flat, rebuild = optim.destructure(model)
    assert flat.shape == (6,)
    back = rebuild(flat * 2)
    assert back["x"] is back["y"] and back["f"] == "keep"
    np.testing.assert_allclose(back["z"], [6, 8, 10, 12])


def test_gradient_through_rebuild_sums_tied_copies():
    s, t = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    model = {"x": s, "y": t, "z": s}
    flat, rebuild = optim.destructure(model)
    g = jax.grad(lambda v: 3 * jnp.sum(rebuild(v)["x"]) + 13 * jnp.sum(rebuild(v)["z"]))(flat)
    np.testing.assert_allclose(g, [16, 16, 0, 0])
    g = jax.grad(lambda v: 4 * (jnp.sum(rebuild(v)["x"]) + jnp.sum(rebuild(v)["y"]))
                 + 13 * jnp.sum(rebuild(v)["z"]))(flat)
    np.testing.assert_allclose(g, [17, 17, 4, 4])


def test_rebuild_wrong_length_raises():
    _, rebuild = optim.destructure({"a": jnp.ones(3)})
    with pytest.raises(ValueError, match="length 3"):
        rebuild(jnp.ones(4))


def test_dtypes_kept_and_promoted():
    flat, rebuild = optim.destructure({"a": jnp.ones(2, jnp.float16)})
    assert flat.dtype == jnp.float16
    flat, rebuild = optim.destructure({"a": jnp.ones(2, jnp.float16), "b": jnp.ones(1, jnp.float32)})
    assert flat.dtype == jnp.float32
    back = rebuild(flat)
    assert back["a"].dtype == jnp.float16 and back["b"].dtype == jnp.float32


def test_rebuild_under_jit():
    model = {"a": jnp.ones(2), "b": [jnp.zeros((2, 2))]}
    flat, rebuild = optim.destructure(model)
    out = jax.jit(rebuild)(flat + 1)
    np.testing.assert_allclose(out["b"][0], np.ones((2, 2)))
