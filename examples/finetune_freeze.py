"""Fine-tune a pretrained backbone with a new head, unfreezing it gradually with `optim.freeze` / `optim.thaw`.

    python examples/finetune_freeze.py            # ~20 s on 2 CPU cores
    python examples/finetune_freeze.py --steps 40 # shorter stages

1. Pretrain a 3-layer MLP backbone plus a head on task A (plenty of data).
2. Swap in a new head for task B (little data). `optim.setup(rule, new_model, like=old_state)` keeps the
   backbone's Adam moments and starts the new head fresh.
3. Gradual unfreezing: train the head alone (backbone frozen), then thaw the top backbone layer, then the
   rest, lowering the learning rate with `optim.adjust` for the last stage (no recompilation: the learning rate
   is data in the state). Frozen parameters get no step and their optimiser state is not advanced.
The script checks that frozen layers did not move and that thawed ones did, and compares with training the
whole model at once from the same start.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import optim


def mlp_init(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (a, b)) * np.sqrt(2.0 / a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def backbone_apply(layers, x):
    for layer in layers:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return x


def model_apply(model, x):
    h = backbone_apply(model["backbone"]["layers"], x)
    return h @ model["head"]["w"] + model["head"]["b"]


def mse(model, x, y):
    return jnp.mean((model_apply(model, x) - y) ** 2)


def make_task(key, teacher, n_out, n):
    """Targets are a random linear readout of the same hidden features (what makes transfer work)."""
    kx, kr = jax.random.split(key)
    x = jax.random.normal(kx, (n, teacher[0]["w"].shape[0]))
    readout = jax.random.normal(kr, (teacher[-1]["w"].shape[1], n_out)) / np.sqrt(teacher[-1]["w"].shape[1])
    return x, backbone_apply(teacher, x) @ readout


@jax.jit
def train_step(state, model, x, y):
    loss, grads = jax.value_and_grad(mse)(model, x, y)
    state, model = optim.update(state, model, grads)
    return state, model, loss


def fit(state, model, x, y, steps, batch, rng):
    for _ in range(steps):
        i = rng.integers(0, len(x), batch)
        state, model, loss = train_step(state, model, x[i], y[i])
    return state, model, float(loss)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps per fine-tuning stage (default 300)")
    p.add_argument("--pretrain-steps", type=int, default=1500, help="pretraining steps (default 1500)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    k = jax.random.split(jax.random.key(args.seed), 6)
    sizes = [16, 64, 64, 64]
    teacher = mlp_init(k[0], sizes)
    xa, ya = make_task(k[1], teacher, 32, 8192)      # task A: lots of data, many outputs
    xb, yb = make_task(k[2], teacher, 3, 256)        # task B: little data
    xb_val, yb_val = make_task(k[2], teacher, 3, 256 + 2048)
    xb_val, yb_val = xb_val[256:], yb_val[256:]      # same readout (same key), unseen inputs

    # 1. Pretrain backbone + head A.
    rule = optim.Adam(3e-3)
    model = {"backbone": {"layers": mlp_init(k[3], sizes)}, "head": mlp_init(k[4], [64, 32])[0]}
    state = optim.setup(rule, model)
    state, model, loss = fit(state, model, xa, ya, args.pretrain_steps, 128, rng)
    print(f"pretrained on task A: loss {loss:.4f}")

    # 2. New head for task B. like=state keeps the backbone's optimiser state (same paths, shapes and dtypes);
    #    the head has a new shape (3 outputs instead of 32), so it starts fresh.
    new = {"backbone": model["backbone"], "head": mlp_init(k[5], [64, 3])[0]}
    state_b = optim.setup(rule, new, like=state)
    kept = [p for p in state_b.paths() if p.startswith("backbone")]
    same = lambda a, b: all(bool((x == y).all()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert all(same(state_b[p].state, state[p].state) for p in kept), "backbone state was not carried over"
    start_model, start_state = new, state_b
    val = jax.jit(mse)
    print(f"task B before fine-tuning: val loss {float(val(new, xb_val, yb_val)):.4f}  "
          f"(kept the Adam state of {len(kept)} backbone parameters, head starts fresh)")

    # 3. Gradual unfreezing.
    stages = [
        ("head only", lambda s: optim.freeze(s, "backbone")),
        ("+ top layer", lambda s: optim.thaw(s, "backbone.layers.2")),
        ("+ all layers, lr/3", lambda s: optim.adjust(optim.thaw(s), lr=1e-3)),
    ]
    history = []
    for name, change in stages:
        state_b = change(state_b)
        frozen = [p for p, leaf in state_b.items() if leaf.frozen]
        before = jax.tree.map(np.asarray, new)
        state_b, new, loss = fit(state_b, new, xb, yb, args.steps, 32, rng)
        # Frozen parameters did not move; the others did.
        for path, _ in optim.trainables(new, path=True):
            moved = not np.array_equal(_at(before, path), _at(new, path))
            assert moved != (path in frozen), f"{path}: frozen={path in frozen} but moved={moved}"
        v = float(val(new, xb_val, yb_val))
        history.append(v)
        print(f"  stage {name:<20} frozen {len(frozen)}/{len(state_b)} parameters  "
              f"train {loss:.4f}  val {v:.4f}")

    # Baselines with the same number of steps: everything trainable from the pretrained start, and from scratch.
    total = len(stages) * args.steps
    _, base, _ = fit(start_state, start_model, xb, yb, total, 32, rng)
    base_val = float(val(base, xb_val, yb_val))
    scratch = {"backbone": {"layers": mlp_init(k[3], sizes)}, "head": mlp_init(k[5], [64, 3])[0]}
    _, scratch, _ = fit(optim.setup(rule, scratch), scratch, xb, yb, total, 32, rng)
    scratch_val = float(val(scratch, xb_val, yb_val))
    print(f"same {total} steps, nothing frozen:  from the pretrained backbone val {base_val:.4f}, "
          f"from scratch val {scratch_val:.4f}")
    print(f"gradual unfreezing: best val {min(history):.4f}   done in {time.perf_counter() - t0:.1f} s")
    return history, base_val, scratch_val


def _at(tree, path):
    """The leaf at a dotted path (dict keys and list indices)."""
    for part in path.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return np.asarray(tree)


if __name__ == "__main__":
    main()
