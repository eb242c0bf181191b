"""Which backends this process has: asked once, by the fused CPU kernel (`optim._engine.fused`) and by XLA's
path's groups (`optim._engine.group`)."""

from __future__ import annotations

import jax

__all__ = ["only_cpu", "own_kernel_may_run"]


def own_kernel_may_run(ctx) -> bool:
    """Whether a lowering rule (its `ctx`) may emit a kernel of optim's own: the program runs on one device (over
    several, XLA partitions its own operations only) and is not exported (`jax.export` takes only custom calls
    with a stability guarantee)."""
    ctx_m = ctx.module_context
    ax = ctx_m.axis_context
    one_device = type(ax).__name__ == "SingleDeviceAxisContext" or (
        type(ax).__name__ == "ShardingContext" and ax.num_devices == 1)
    return one_device and not ctx_m.lowering_parameters.for_export


def only_cpu() -> bool:
    """Whether this process has no backend but the CPU (then the kernel is used without a platform switch)."""
    global _ONLY_CPU
    if _ONLY_CPU is None:
        _ONLY_CPU = jax.default_backend() == "cpu" and {d.platform for d in jax.devices()} == {"cpu"}
        for other in ("gpu", "tpu"):
            try:
                jax.devices(other)
                _ONLY_CPU = False
            except RuntimeError:
                pass
    return _ONLY_CPU


_ONLY_CPU: bool | None = None
