"""Writes `tests/data/shampoo_reference.npz`: precondition-opt's `distributed_shampoo` in float64 on the problem
of `tests/shampoo_problem.py` (its `REFERENCE` configurations), the parameters after every step.

Run it in a virtual environment of its own (precondition-opt pins nothing and needs chex; flax, which it imports
only for `flax.struct`, is replaced by a small stand-in below):

    python3 -m venv /tmp/refenv && /tmp/refenv/bin/pip install precondition-opt==0.3.0 chex
    /tmp/refenv/bin/python tests/data/make_shampoo_reference.py [tests/data/shampoo_reference.npz]

The stored fixture was made with precondition-opt 0.3.0, jax 0.10.2, optax 0.2.8 and chex from PyPI, with x64
enabled and its `jnp.float32` made float64 (it allocates its statistics and roots in float32 whatever x64 says):
all in float64, its inverse roots by `eigh=True`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shampoo_problem import CONFIGS, NSTEPS, REFERENCE, gradient, initial, reference_kwargs  # noqa: E402


def _flax_stand_in() -> None:
    """`flax.struct.dataclass` and `flax.struct.field` (all precondition-opt uses of flax) on JAX's own
    `register_dataclass`; and the `jax.tree_*` aliases that newer JAX removed."""
    import jax

    def field(pytree_node=True, **kwargs):
        return dataclasses.field(metadata={"pytree_node": pytree_node}, **kwargs)

    def dataclass(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        fields = dataclasses.fields(cls)
        data = [f.name for f in fields if f.metadata.get("pytree_node", True)]
        meta = [f.name for f in fields if not f.metadata.get("pytree_node", True)]
        cls.replace = lambda self, **kw: dataclasses.replace(self, **kw)
        return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)

    struct = types.ModuleType("flax.struct")
    struct.field, struct.dataclass = field, dataclass
    flax = types.ModuleType("flax")
    flax.struct = struct
    sys.modules["flax"], sys.modules["flax.struct"] = flax, struct
    jax.tree_map = jax.tree.map
    jax.tree_flatten = jax.tree_util.tree_flatten
    jax.tree_unflatten = jax.tree_util.tree_unflatten


class _Float64(types.SimpleNamespace):
    """`jax.numpy` with `float32` meaning float64 (the module's name for it in precondition-opt)."""

    def __init__(self, jnp):
        super().__init__()
        self._jnp = jnp

    def __getattr__(self, name):
        return self._jnp.float64 if name == "float32" else getattr(self._jnp, name)


def run(config: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from precondition import distributed_shampoo as ds, quantization_utils as qu

    ds.jnp = qu.jnp = _Float64(jnp)      # its statistics and roots are float32 arrays whatever x64 says
    tx = ds.distributed_shampoo(**reference_kwargs(config), generate_training_metrics=False)
    x = {k: jnp.asarray(v) for k, v in initial().items()}
    state = tx.init(x)
    update = jax.jit(tx.update)
    out = {k: [] for k in x}
    for t in range(NSTEPS):
        g = {k: jnp.asarray(v) for k, v in gradient({k: np.asarray(v) for k, v in x.items()}, t).items()}
        u, state = update(g, state, x)
        x = jax.tree.map(lambda a, b: a + b, x, u)
        for k in x:
            out[k].append(np.asarray(x[k], np.float64))
    return {k: np.stack(v) for k, v in out.items()}


def main(path: str) -> None:
    import jax
    jax.config.update("jax_enable_x64", True)
    _flax_stand_in()
    arrays = {}
    for name in REFERENCE:
        for k, v in run(CONFIGS[name]).items():
            arrays[f"{name}/{k}"] = v
    np.savez_compressed(path, **arrays)
    print(f"wrote {path}: {', '.join(REFERENCE)}")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "shampoo_reference.npz"))
