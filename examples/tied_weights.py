"""A tied model trained with optax (the copies drift apart) and with optim (one parameter).

Run: `make demo` or `python examples/tied_weights.py`.
"""

import jax
import jax.numpy as jnp
import optax

import optim

w = jnp.array([1.0, 2.0, 3.0])
model = {"enc": w, "dec": w}          # the same array in two places: one parameter


def loss(m):
    return jnp.sum(m["enc"] ** 2) - 10 * jnp.sum(m["dec"])


# optax: two leaves, two Adam states; the copies drift apart.
tx = optax.adam(0.1)
params, opt_state = model, tx.init(model)
for _ in range(3):
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    params = optax.apply_updates(params, updates)
print("optax  enc", params["enc"], " dec", params["dec"])

# optim: one parameter, gradients summed, the same array written back to both places.
state = optim.setup(optim.Adam(0.1), model)
m = model
for _ in range(3):
    state, m = optim.update(state, m, jax.grad(loss)(m))
print("optim  enc", m["enc"], " dec", m["dec"], " same array:", m["enc"] is m["dec"])
print(state)
