"""chex where it serves: one core check (an `optim.update` step on a tied model) run eagerly, under `jax.jit` and
under `jax.pmap` by `chex.variants`, against exact references, and chex's tree assertions where trees are compared.

The pmap variant runs on however many devices JAX sees (one CPU device here): chex gives every device a copy of the
arguments and returns the first device's result, so all three variants are held to the same numbers.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.flags import FLAGS

import optim


def tied_model():
    w = jnp.array([1.0, 2.0, 3.0])
    return {"enc": w, "dec": w, "b": jnp.array([0.5])}   # "enc" and "dec": one array, one parameter


def loss(m):
    return jnp.sum(m["enc"] ** 2) - 10 * jnp.sum(m["dec"]) + jnp.sum(m["b"] ** 2)


def adam_reference(w, grad, steps, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
    """Adam (Kingma & Ba) on one parameter in float64: `steps` steps of the gradient function `grad`."""
    w = np.asarray(w, np.float64)
    m = v = np.zeros_like(w)
    for t in range(1, steps + 1):
        g = grad(w)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        w = w - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return w


class TiedUpdateTest(chex.TestCase):
    # chex skips its pmap variant on a single device unless told otherwise; pmap over one device is still pmap.
    def setUp(self):
        super().setUp()
        self._skip_pmap = FLAGS["chex_skip_pmap_variant_if_single_device"].value
        FLAGS["chex_skip_pmap_variant_if_single_device"].value = False

    def tearDown(self):
        FLAGS["chex_skip_pmap_variant_if_single_device"].value = self._skip_pmap
        super().tearDown()

    @chex.variants(without_jit=True, with_jit=True, with_pmap=True)
    def test_descent_step_sums_the_tied_gradients(self):
        model = tied_model()
        state = optim.setup(optim.Descent(0.25), model)
        grads = {"enc": jnp.array([1.0, 2.0, 4.0]), "dec": jnp.array([3.0, -2.0, 0.0]), "b": jnp.array([2.0])}
        new_state, new = self.variant(optim.update)(state, model, grads)
        # One parameter for the tie: [1, 2, 3] - 0.25 * ([1, 2, 4] + [3, -2, 0]); "b": 0.5 - 0.25 * 2. Exact.
        chex.assert_trees_all_equal(new, {"enc": np.array([0.0, 2.0, 2.0]), "dec": np.array([0.0, 2.0, 2.0]),
                                          "b": np.array([0.0])}, strict=False)
        chex.assert_trees_all_equal_shapes_and_dtypes(new, model)
        chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)   # the state keeps its layout
        chex.assert_trees_all_equal(new_state.step, 1, strict=False)

    @chex.variants(without_jit=True, with_jit=True, with_pmap=True)
    def test_adam_on_a_tie_matches_one_parameter_in_float64(self):
        model = tied_model()
        state = optim.setup(optim.Adam(0.1), model)
        step = self.variant(lambda state, model: optim.update(state, model, jax.grad(loss)(model)))
        for _ in range(3):
            state, model = step(state, model)
        # The tie is one parameter whose gradient is the sum over its places: 2 w - 10.
        w = adam_reference([1.0, 2.0, 3.0], lambda w: 2 * w - 10, 3)
        b = adam_reference([0.5], lambda b: 2 * b, 3)
        np.testing.assert_allclose(w, [1.2997262, 2.2996185, 3.2993766], rtol=1e-7)
        np.testing.assert_allclose(b, [0.2048713], rtol=1e-6)
        # float32 against float64: the bias correction's 1 - β₂ᵗ, rounded to float32, is off by up to 6e-5 of
        # itself at t = 1, which moves the parameters by up to ~5e-6 of their value after three steps.
        chex.assert_trees_all_close(model, {"enc": w, "dec": w, "b": b}, rtol=1e-5, atol=0)
        # What the docs' first example prints (float32), to about an ulp.
        chex.assert_trees_all_close(model["enc"], np.array([1.2997252, 2.2996173, 3.2993755]), rtol=3e-7, atol=0)
        chex.assert_trees_all_equal_shapes(state, optim.setup(optim.Adam(0.1), tied_model()))


def test_tie_grads_puts_the_sum_at_the_canonical_place():
    model = tied_model()
    state = optim.setup(optim.Adam(0.1), model)
    grads = {"enc": jnp.array([1.0, 2.0, 4.0]), "dec": jnp.array([3.0, -2.0, 0.0]), "b": jnp.array([2.0])}
    # The sum at the tie's canonical place ("dec": the first in key order), None at its other places.
    chex.assert_trees_all_equal(optim.tie_grads(state, grads),
                                {"enc": None, "dec": np.array([4.0, 0.0, 4.0]), "b": np.array([2.0])}, strict=False)


def test_jitted_steps_on_a_tie_trace_once():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, model):
        return optim.update(state, model, jax.grad(loss)(model))

    model = tied_model()
    state = optim.setup(optim.Adam(0.1), model)
    for _ in range(3):
        state, model = step(state, model)           # a fourth trace would raise
    chex.assert_trees_all_equal(model["enc"], model["dec"])
    chex.assert_trees_all_close(model["enc"], np.array([1.2997252, 2.2996173, 3.2993755]), rtol=3e-7, atol=0)
