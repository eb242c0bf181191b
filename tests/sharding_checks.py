"""A check shared by the parallel and multi-host scripts (`parallel_cases.py`, `multihost_worker.py`)."""

from __future__ import annotations

import jax


def misplaced_state(optim, state, model) -> list[str]:
    """Paths whose state arrays (shaped like the parameter) do not carry the parameter's sharding."""
    flat = dict(optim.trainables(model, path=True))
    bad = []
    for path, leaf in state.items():
        x = flat[path]
        for a in jax.tree.leaves(leaf.state):
            if getattr(a, "shape", None) == x.shape and x.ndim:
                sh = getattr(a, "sharding", None)
                if sh is None or not sh.is_equivalent_to(x.sharding, x.ndim):
                    bad.append(f"{path}: {type(a).__name__} {sh}")
    return bad
