"""Which backends this process has: asked once, by the fused CPU kernel (`optim._engine.fused`) and by XLA's
path's groups (`optim._engine.group`)."""

from __future__ import annotations

import jax

__all__ = ["only_cpu"]


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
