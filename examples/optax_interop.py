"""An unmodified optax training loop on a tied model, made tie-correct by changing one line.

The model is a tiny language model whose output projection is its embedding matrix: one array in two places
of the params dict. optax sees two parameters, gives each its own Adam state, and the copies drift apart.
`optim.to_optax(...)` is an ordinary `optax.GradientTransformation` that sums the tied gradients and steps the
parameter once; the loop below (tx.init / tx.update / optax.apply_updates inside jax.jit) is not changed.

Run: `python examples/optax_interop.py`
"""

import jax
import jax.numpy as jnp
import optax

import optim

VOCAB, DIM, STEPS = 16, 8, 200
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
EMB = 0.5 * jax.random.normal(k1, (VOCAB, DIM))
PROJ = jax.random.normal(k2, (DIM, DIM)) / DIM ** 0.5
TOKENS = jax.random.randint(k3, (64,), 0, VOCAB)
TARGETS = (TOKENS * 3 + 1) % VOCAB                     # a fixed next-token rule to learn


def make_params():
    return {"embed": EMB, "proj": PROJ, "unembed": EMB}   # unembed IS embed: a tied output projection


def loss(params, tokens, targets):
    h = jnp.tanh(params["embed"][tokens] @ params["proj"])
    logits = h @ params["unembed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train(tx):
    """A plain optax training loop: nothing optim-specific in it."""
    params = make_params()
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state):
        loss_value, grads = jax.value_and_grad(loss)(params, TOKENS, TARGETS)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_value

    for _ in range(STEPS):
        params, opt_state, loss_value = train_step(params, opt_state)
    return params, float(loss_value)


def reference():
    """optax on the same network written with ONE embedding used twice: what a tied model must do."""
    tx = optax.adam(1e-2)
    params = {"embed": EMB, "proj": PROJ}
    tied = lambda p: {**p, "unembed": p["embed"]}
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state):
        grads = jax.grad(lambda p: loss(tied(p), TOKENS, TARGETS))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(STEPS):
        params, opt_state = train_step(params, opt_state)
    return params


def report(name, params, loss_value, ref):
    drift = float(jnp.max(jnp.abs(params["embed"] - params["unembed"])))
    off = float(jnp.max(jnp.abs(params["embed"] - ref["embed"])))
    print(f"{name:44s} loss {loss_value:.4f}   |embed - unembed| {drift:.2e}   |embed - tied reference| {off:.2e}")


if __name__ == "__main__":
    ref = reference()
    print(f"{STEPS} Adam steps on a model whose output projection is its embedding (one array, two places)\n")

    tx = optax.adam(1e-2)                                           # plain optax: two parameters
    report("optax.adam", *train(tx), ref)

    tx = optim.to_optax(optim.from_optax(optax.adam(1e-2)))         # the one changed line
    report("optim.to_optax(optim.from_optax(optax.adam))", *train(tx), ref)

    tx = optim.to_optax(optim.Adam(1e-2))                           # or an optim rule
    report("optim.to_optax(optim.Adam)", *train(tx), ref)
    print("\nplain optax drifted: embed and unembed are two different matrices now (its lower loss is that of an\n"
          "untied model); with optim they stay one parameter and match optax on the model written with one\n"
          "embedding (up to float32 rounding).")
