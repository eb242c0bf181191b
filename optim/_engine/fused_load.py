"""Loading optim's fused CPU kernel (`optim/_engine/fused.cc`, built by setup.py): the shared library is
registered with XLA as FFI targets, unless its build record says this jaxlib cannot run it."""

from __future__ import annotations

import ctypes
import glob
import os

import jax

__all__ = ["load"]

TARGET = "optim_fused"
FINITE = "optim_finite"  # whether arrays are all finite (optim/_engine/fused.cc): SkipNonFinite's question
QUANTIZED = "optim_adam_quantized"   # the one-pass quantised Adam step (optim/_engine/fused_quantized.cc)
_KERNEL = "_fused_kernel.so"       # built by setup.py: a plain shared library, one file for every Python version
_RECORD = "_fused_kernel.json"     # beside it (setup.py): the jaxlib and XLA FFI API version it was compiled against


def _ffi_api(include: str) -> tuple[int, int] | None:
    """`(major, minor)`: the XLA FFI API version declared by the headers in `include` (a jaxlib's include folder)."""
    import re

    try:
        with open(os.path.join(include, "xla", "ffi", "api", "c_api.h")) as f:
            text = f.read()
    except OSError:
        return None
    found = [re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR")]
    return (int(found[0].group(1)), int(found[1].group(1))) if all(found) else None


def _refusal(built: dict, jaxlib: str, ffi: tuple[int, int] | None) -> str | None:
    """Why a kernel whose build record is `built` must not be registered with jaxlib `jaxlib`, whose headers declare
    XLA FFI API version `ffi` (None: it may be).

    XLA compares a handler's FFI API version with its own only when the CPU backend starts, and a mismatch then
    stops the backend (`Unable to initialize backend 'cpu'`: no JAX program runs), so the versions are compared
    here, before registering. The major versions must agree and the kernel's minor version be at most this
    jaxlib's: XLA runs handlers built against older minor versions (xla/ffi/api/c_api.h), so a kernel compiled
    against one jaxlib runs under a newer one of the same FFI API. Without an FFI version on either side, the
    jaxlib versions must be equal.
    """
    api, was = built.get("ffi_api"), built.get("jaxlib")
    if api and ffi:
        if api[0] == ffi[0] and api[1] <= ffi[1]:
            return None
        return (f"it was built against jaxlib {was} (XLA FFI API {api[0]}.{api[1]}), which jaxlib {jaxlib} "
                f"(FFI API {ffi[0]}.{ffi[1]}) cannot run")
    if was == jaxlib:
        return None
    return f"it was built against jaxlib {was}, this is jaxlib {jaxlib}, and the XLA FFI API version is unknown"


def load(folder: str = os.path.dirname(__file__)) -> tuple[bool, str]:
    """`(available, why)`: register the kernel in `folder` with XLA, unless its build record says this jaxlib
    cannot run it (see `_refusal`)."""
    import importlib.metadata
    import json

    path = os.path.join(folder, _KERNEL)
    if not os.path.exists(path):
        stale = glob.glob(os.path.join(folder, "_fused_kernel.*.so"))
        return False, ("optim's fused CPU kernel was not built at install (no C++ compiler, or "
                       "OPTIM_BUILD_FUSED=0)" if not stale else
                       f"optim's fused CPU kernel was installed by an older optim ({stale[0]}): reinstall optim")
    try:
        with open(os.path.join(folder, _RECORD)) as f:
            built = json.load(f)
        jaxlib = importlib.metadata.version("jaxlib")
    except (OSError, ValueError, importlib.metadata.PackageNotFoundError) as e:
        return False, f"optim's fused CPU kernel {path} was not loaded: no build record or jaxlib version ({e!r})"
    was = built.get("jaxlib")
    why = _refusal(built, jaxlib, _ffi_api(jax.ffi.include_dir()))
    if why:
        return False, (f"optim's fused CPU kernel {path} was not loaded: {why}; rebuild it against this jaxlib "
                       "(pip install --force-reinstall --no-deps --no-build-isolation --no-binary optim-jax optim-jax, "
                       f"with setuptools and a C++ compiler) or install jaxlib {was}")
    try:
        lib = ctypes.CDLL(path)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.optim_fused), platform="cpu")
        jax.ffi.register_ffi_target(FINITE, jax.ffi.pycapsule(lib.optim_finite), platform="cpu")
        jax.ffi.register_ffi_target(QUANTIZED, jax.ffi.pycapsule(lib.optim_adam_quantized), platform="cpu")
    except Exception as e:      # a broken file: the JAX path still works
        return False, f"optim's fused CPU kernel {path} could not be loaded: {e!r}"
    also = "" if was == jaxlib else f" (built against jaxlib {was}, runs under jaxlib {jaxlib})"
    return True, f"optim's fused CPU kernel: {path}{also}, {isa(lib)} loops"


def isa(lib: ctypes.CDLL) -> str:
    """Which build of the kernel's element loops runs in this process (the best the CPU has, at most the one the
    environment variable `OPTIM_FUSED_ISA` names: baseline, avx2 or avx512)."""
    try:
        return _ISAS[lib.optim_isa()]
    except (AttributeError, IndexError):
        return "unknown"


_ISAS = ("baseline x86-64", "AVX2", "AVX-512")
