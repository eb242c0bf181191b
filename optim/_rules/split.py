"""Splitting a stack's per-matrix work across devices: the matrix rules (`Muon`, `NorMuon`, `Shampoo`, `Kron`,
`SOAP`) step the matrices of one shape as a stack (a leading axis over them), and on a mesh of several devices
each device steps its share of the stack's rows (each row's whole step: Newton-Schulz, eigendecompositions,
roots, and the elementwise rest), the new states and steps then gathered, instead of every device stepping
every matrix.

`rows(f, shared, *stacks)` is `f(shared, *stacks)`, run under `jax.shard_map` with the stacks' leading axis
split over every axis of the mesh (flattened) and `shared` (the rule, with its traced hyperparameters, and
anything else every row reads) replicated; the result is gathered back to replicated. A stack whose length
the device count does not divide is padded by repeating its first rows (their results dropped), so that each
device steps `ceil(n / devices)` rows. Each row's program is the one a single device runs on it, so the result
equals the single-device one to rounding.

The mesh: the current abstract mesh (`jax.set_mesh`), else the one the engine names for the step (`over`:
where `setup` saw the parameters or their requested state sharding live). Nothing is split on one device,
inside `shard_map` or `pmap` (each device then steps its own copy: its axes are Manual), or for a stack of one
row; nor with `ENABLED` off.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

__all__ = ["ENABLED", "over", "mesh_of", "current", "rows"]

# Whether stacks are split at all (a switch of the engine's: optim._engine.strategies.switch): off, every device
# steps every matrix, as XLA partitions the replicated program.
ENABLED = True
_MESH: contextvars.ContextVar = contextvars.ContextVar("optim_split_mesh", default=None)


@contextlib.contextmanager
def over(mesh: Any) -> Iterator[None]:
    """Within it, `current()` falls back to `mesh` (None: nothing) where no abstract mesh is set."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def mesh_of(shardings: Any) -> Any:
    """The mesh of the first `NamedSharding` of `shardings` that spans several devices, or None."""
    for s in shardings:
        if isinstance(s, NamedSharding) and s.mesh.size > 1:
            return s.mesh
    return None


def current() -> Any:
    """The mesh a stack's rows are split over here, or None (see the module)."""
    if not ENABLED:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = _MESH.get()
    if mesh is None or mesh.size < 2 or AxisType.Manual in tuple(mesh.axis_types):
        return None
    return mesh


def key() -> Any:
    """What tracing a split step depends on (for caches of traced steps): the current mesh."""
    return current()


def rows(f: Callable, shared: Any, *stacks: Any) -> Any:
    """`f(shared, *stacks)`, every leaf of `stacks` (pytrees) holding one row per matrix on its leading axis and
    `f` computing each row from that row alone (with `shared`): on a mesh of several devices each device runs
    `f` on its share of the rows, and the result (every leaf with the same leading axis) is gathered to every
    device. Elsewhere `f(shared, *stacks)` itself."""
    mesh = current()
    n = jax.tree.leaves(stacks)[0].shape[0] if jax.tree.leaves(stacks) else 0
    if mesh is None or n < 2:
        return f(shared, *stacks)
    names = tuple(mesh.axis_names)
    split, whole = PartitionSpec(names), PartitionSpec()
    devices = math.prod(mesh.axis_sizes)
    padded = -(-n // devices) * devices
    index = np.arange(padded) % n
    explicit = AxisType.Explicit in tuple(mesh.axis_types)

    def place(a: Any, spec: PartitionSpec) -> Any:
        # on Explicit axes shard_map takes its arguments only as its in_specs say (a slice: no communication)
        return jax.sharding.reshard(a, NamedSharding(mesh, spec)) if explicit else a

    stacks = jax.tree.map(lambda a: place(a if padded == n else a[index], split), stacks)
    shared = jax.tree.map(lambda a: place(a, whole), shared)
    out = jax.shard_map(lambda s, *t: f(s, *t), mesh=mesh, in_specs=(whole,) + (split,) * len(stacks),
                        out_specs=split, check_vma=False)(shared, *stacks)

    def gather(a: Any) -> Any:
        a = (jax.sharding.reshard(a, NamedSharding(mesh, whole)) if explicit
             else jax.lax.with_sharding_constraint(a, NamedSharding(mesh, whole)))
        return a if padded == n else a[:n]

    return jax.tree.map(gather, out)
