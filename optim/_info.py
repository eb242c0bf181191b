"""`optim.print_info()` and `python -m optim`: the versions and the fused kernel's status, for bug reports."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from typing import IO


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _kernel() -> list[str]:
    """The fused CPU kernel's lines: whether it is loaded and used, why not, what it was built against."""
    from ._engine import fused, fused_load

    if not fused.AVAILABLE:
        state = "not available (update runs the pure-JAX path)"
    elif fused.ENABLED:
        state = "available, enabled"
    else:
        state = "available, turned off (OPTIM_FUSED=0)"
    lines = [f"fused CPU kernel: {state}", f"  {fused.WHY}"]
    record = os.path.join(os.path.dirname(fused.__file__), fused_load._RECORD)
    try:
        with open(record) as f:
            built = json.load(f)
        api = ".".join(map(str, built.get("ffi_api") or ["?"]))
        lines.append(f"  built against jaxlib {built.get('jaxlib')} (XLA FFI API {api})")
    except (OSError, ValueError):
        pass
    return lines


def _devices() -> list[str]:
    import jax

    try:
        devices = jax.devices()
        backend = jax.default_backend()
    except Exception as e:      # a backend that does not start is what a bug report needs to show
        return [f"devices: none: {type(e).__name__}: {e}"]
    return [f"default backend: {backend}", f"devices: {len(devices)}: " + ", ".join(map(str, devices))]


def print_info(file: IO[str] | None = None) -> None:
    """Print optim's, jax's, jaxlib's and Python's versions, the platform, the devices, and whether optim's fused
    CPU kernel is loaded and used (and why not), for a bug report. `python -m optim` prints the same.

    `jax.print_environment_info()` adds what JAX knows (numpy, GPU driver versions).

    Args:
        file: where to print, default `sys.stdout`.

    >>> import optim
    >>> optim.print_info()  # doctest: +ELLIPSIS
    optim: ...
    jax: ...
    """
    import jax

    optim = sys.modules[__package__]     # the package this is part of, imported first (no import cycle)
    lines = [
        f"optim: {optim.__version__} ({os.path.dirname(optim.__file__)})",
        f"jax: {jax.__version__}",
        f"jaxlib: {_version('jaxlib')}",
        f"numpy: {_version('numpy')}",
        f"python: {sys.version.split()[0]} ({sys.executable})",
        f"platform: {platform.platform()}",
        f"OPTIM_FUSED: {os.environ.get('OPTIM_FUSED', '(unset)')}",
        f"OPTIM_FUSED_ISA: {os.environ.get('OPTIM_FUSED_ISA', '(unset)')}",
        *_kernel(),
        *_devices(),
    ]
    print("\n".join(lines), file=file or sys.stdout)
