"""The README's runnable code blocks run and print what the README says."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_tie_problem_block(capsys):
    block = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    scope: dict = {}
    exec(block, scope)
    np.testing.assert_allclose(scope["p"]["enc"], [0.70, 1.70, 2.70], atol=5e-3)
    np.testing.assert_allclose(scope["p"]["dec"], [1.30, 2.30, 3.30], atol=5e-3)
    np.testing.assert_allclose(scope["m"]["dec"], [1.2997, 2.2996, 3.2994], atol=1e-4)
    assert scope["m"]["enc"] is scope["m"]["dec"]


def test_custom_rule_block():
    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "class SignSGD" in b)
    scope: dict = {}
    exec("import jax.numpy as jnp, optim\n" + block, scope)
    import jax.numpy as jnp
    import optim
    s = optim.setup(scope["SignSGD"](0.5), {"w": jnp.ones(2)})
    np.testing.assert_allclose(optim.update(s, {"w": jnp.ones(2)}, {"w": jnp.array([1.0, -1.0])})[1]["w"],
                               [0.5, 1.5])


def test_beyond_the_anchors_block():
    import jax
    import jax.numpy as jnp
    import optim

    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "ClipGlobalNorm" in b)
    w = jnp.array([3.0, 4.0])
    scope = {"jax": jax, "optim": optim, "model": {"a": w, "b": w}, "grads": {"a": w, "b": w}}
    exec(block, scope)
    assert int(scope["state"].step) == 1
    np.testing.assert_allclose(float(optim.global_norm(scope["g"])), 10.0, rtol=1e-6)


def test_optax_block():
    import jax
    import jax.numpy as jnp
    import optim

    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "to_optax" in b)
    w = jnp.array([1.0, 2.0])
    scope = {"jax": jax, "optim": optim, "model": {"a": w, "b": w}, "grads": {"a": jnp.ones(2), "b": jnp.ones(2)}}
    exec(block, scope)
    assert scope["state"].ties() == {"a": ("b",)}
    np.testing.assert_allclose(scope["model"]["a"], scope["model"]["b"])
    assert not np.allclose(scope["model"]["a"], w)
