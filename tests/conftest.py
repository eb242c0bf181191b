"""Helpers shared by the test files: `from conftest import close, arr, counted_update`.

pytest imports the test files with `tests/` on `sys.path` (its default "prepend" import mode; there is no
`tests/__init__.py`), so this conftest is an ordinary importable module too, like `test_rules` is for
`test_stacking`.
"""

import jax
import jax.numpy as jnp
import numpy as np


def close(a, b, rtol=1e-6, atol=1e-6, err_msg=""):
    """`np.testing.assert_allclose` on any array-likes (jax or numpy arrays, lists, scalars), compared in
    float64, or complex128 when either side is complex, so float16 / bfloat16 / complex results compare alike.

    The default (rtol 1e-6, atol 1e-6) suits float32 results checked against exact numbers; a test that needs
    another tolerance passes it, and `rtol=0, atol=0` asks for equal values."""
    a, b = np.asarray(a), np.asarray(b)
    dtype = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
    np.testing.assert_allclose(a.astype(dtype), b.astype(dtype), rtol=rtol, atol=atol, err_msg=err_msg)


def arr(*values, dtype=jnp.float32):
    """A 1-D jax array of the given numbers: `arr(1, 2)` is float32 [1, 2]."""
    return jnp.array(values, dtype=dtype)


def counted_update():
    """`(step, traces)`: `optim.update` under `jax.jit`, and a list that grows by one each time it traces, so a
    test can count recompilations (`len(traces)`)."""
    import optim

    traces: list = []

    @jax.jit
    def step(state, model, grads):
        traces.append(1)
        return optim.update(state, model, grads)

    return step, traces
