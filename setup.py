"""Build of optim's one compiled part, the fused CPU kernel (`optim/_engine/fused.cc`, an XLA FFI custom call).

Everything else is in pyproject.toml. The kernel is optional: it is compiled with the system's C++ compiler
against the XLA FFI headers that jaxlib ships, and when there is no compiler, no headers, or the compile fails,
the install still succeeds and optim runs its pure-JAX path (`optim._engine.fused` says why in a debug log).
"""

import importlib.util
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _ffi_headers() -> str | None:
    """jaxlib's include folder (what `jax.ffi.include_dir()` returns), found without importing jaxlib."""
    spec = importlib.util.find_spec("jaxlib")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "include")
        if os.path.exists(os.path.join(path, "xla", "ffi", "api", "ffi.h")):
            return path
    return None


class BuildFused(build_ext):
    def build_extension(self, ext):
        headers = _ffi_headers()
        if headers is None or os.environ.get("OPTIM_BUILD_FUSED", "1") == "0":
            why = "OPTIM_BUILD_FUSED=0" if headers else "no XLA FFI headers (jaxlib) in the build environment"
            print(f"optim: not building the fused CPU kernel ({why}); the pure-JAX path will be used", file=sys.stderr)
            return
        ext.include_dirs.append(headers)
        super().build_extension(ext)   # optional=True: a failed compile is reported and the install goes on


fused = Extension(
    "optim._engine._fused_kernel",
    sources=["optim/_engine/fused.cc"],
    language="c++",
    # -fno-math-errno: sqrt without the errno branch, so the element loop vectorises. -fvisibility=hidden: only the
    # handler symbol is exported.
    extra_compile_args=["-std=c++17", "-O3", "-fno-math-errno", "-fvisibility=hidden", "-w"],
    optional=True,
)

setup(ext_modules=[fused], cmdclass={"build_ext": BuildFused})
