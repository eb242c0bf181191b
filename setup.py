"""Build of optim's one compiled part, the fused CPU kernel (`optim/_engine/fused.cc` and the files beside it, an XLA
FFI custom call).

Everything else is in pyproject.toml. The kernel is optional: it is compiled with the system's C++ compiler
against the XLA FFI headers that jaxlib ships, and when there is no compiler, no headers, or the compile fails,
the install still succeeds and optim runs its pure-JAX path (`optim._engine.fused` says why in a debug log).

The kernel is a plain shared library that `optim._engine.fused` loads with ctypes, not a CPython extension: it uses
no Python symbol, so it is named `_fused_kernel.so` (no `cpython-311-...` suffix) and the wheel is tagged
`py3-none-<platform>`: one wheel serves every supported Python. `make dist` retags that wheel manylinux with
auditwheel.

Beside the kernel, `_fused_kernel.json` records what it was built from: a hash of its source and flags, the
jaxlib whose headers it was compiled against and their FFI API version. A build whose record differs from the
one beside an existing kernel (another source, other flags, another jaxlib) deletes that kernel before compiling,
so a stale one is never reused, even when the new compile fails; `optim._engine.fused` compares the record's FFI
API version with the running jaxlib's before loading the kernel.

`OPTIM_KERNEL_CACHE=folder` keeps each kernel compiled there under the hash of its record, and a build whose
record is there copies it instead of compiling (the same sources, flags and jaxlib give the same kernel): `make
test` sets it, so that the wheel its packaging test builds takes the kernel its editable install compiled.
"""

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

KERNEL = "optim._engine._fused_kernel"
RECORD = "_fused_kernel.json"   # beside the kernel: what it was built from (read by optim._engine.fused_load.load)


def _ffi_headers() -> str | None:
    """jaxlib's include folder (what `jax.ffi.include_dir()` returns), found without importing jaxlib."""
    spec = importlib.util.find_spec("jaxlib")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "include")
        if os.path.exists(os.path.join(path, "xla", "ffi", "api", "ffi.h")):
            return path
    return None


def _ffi_api(headers: str) -> list[int] | None:
    """`[major, minor]`: the XLA FFI API version that the headers declare (`XLA_FFI_API_MAJOR` / `_MINOR`)."""
    with open(os.path.join(headers, "xla", "ffi", "api", "c_api.h")) as f:
        text = f.read()
    found = [re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR")]
    return [int(m.group(1)) for m in found] if all(found) else None


def _record(ext: Extension, headers: str) -> dict:
    """What the kernel is built from; a kernel whose record differs is rebuilt."""
    source = hashlib.sha256()
    for path in ext.sources + list(ext.depends):
        with open(path, "rb") as f:
            source.update(f.read())
    try:
        jaxlib = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        jaxlib = None
    flags = hashlib.sha256(json.dumps([ext.extra_compile_args, ext.extra_link_args]).encode()).hexdigest()
    return {"source_sha256": source.hexdigest(), "flags_sha256": flags, "jaxlib": jaxlib,
            "ffi_api": _ffi_api(headers)}


def _built_from(kernel: str, record: dict) -> bool:
    """Whether `kernel` exists and the record beside it is `record`."""
    try:
        with open(os.path.join(os.path.dirname(kernel), RECORD)) as f:
            return os.path.exists(kernel) and json.load(f) == record
    except (OSError, ValueError):
        return False


def _compile_at_once(compiler) -> None:
    """Makes `compiler.compile` run one compiler process per source, at once (distutils runs them one after the
    other): measured on 2 cores, the kernel compiles in 1 min 35 s this way, 2 min 53 s as one file."""
    one_by_one = compiler.compile
    if getattr(one_by_one, "at_once", False):
        return

    def compile(sources, output_dir=None, **kw):
        for src in sources:   # the object folders, made before the processes start (none races to make them)
            os.makedirs(os.path.dirname(compiler.object_filenames([src], output_dir=output_dir)[0]) or ".",
                        exist_ok=True)
        with ThreadPoolExecutor(max(1, len(sources))) as pool:
            done = list(pool.map(lambda src: one_by_one([src], output_dir=output_dir, **kw), sources))
        return [obj for objs in done for obj in objs]

    compile.at_once = True
    compiler.compile = compile


def _cached(record: dict) -> str | None:
    """Where `OPTIM_KERNEL_CACHE` keeps the kernel built from `record`, with the record beside it, as a build
    leaves them (None: no cache)."""
    folder = os.environ.get("OPTIM_KERNEL_CACHE")
    if not folder:
        return None
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(folder, key, KERNEL.rpartition(".")[2] + ".so")


def _keep(kernel: str, cached: str | None) -> None:
    """Put `kernel` and the record beside it in the cache, if there is one and they are not there yet."""
    if cached is None or not os.path.exists(kernel) or os.path.exists(cached):
        return
    os.makedirs(os.path.dirname(os.path.dirname(cached)), exist_ok=True)
    part = tempfile.mkdtemp(dir=os.path.dirname(os.path.dirname(cached)))
    for name in (kernel, os.path.join(os.path.dirname(kernel), RECORD)):
        shutil.copy2(name, part)
    try:
        os.replace(part, os.path.dirname(cached))   # whole or not at all: another build may be reading the cache
    except OSError:                                  # another build put it there first
        shutil.rmtree(part, ignore_errors=True)


def _remove(*paths: str) -> None:
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


class BuildFused(build_ext):
    def get_ext_filename(self, fullname):
        # A plain shared library loaded with ctypes: no Python ABI in its name (`_fused_kernel.so`). distutils asks
        # for the last part of the name, setuptools' in-place copy for the dotted one.
        if fullname in (KERNEL, KERNEL.rpartition(".")[2]):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extension(self, ext):
        path = self.get_ext_fullpath(ext.name)
        record_path = os.path.join(os.path.dirname(path), RECORD)
        headers = _ffi_headers()
        if headers is None or os.environ.get("OPTIM_BUILD_FUSED", "1") == "0":
            why = "OPTIM_BUILD_FUSED=0" if headers else "no XLA FFI headers (jaxlib) in the build environment"
            print(f"optim: not building the fused CPU kernel ({why}); the pure-JAX path will be used", file=sys.stderr)
            _remove(path, record_path)   # nor ship one built before
            return
        record = _record(ext, headers)
        # An editable install builds in a new folder each time: the kernel beside the sources is the one to reuse;
        # then the cache's (OPTIM_KERNEL_CACHE), which a build of another copy of the sources may have left.
        inplace = self._get_inplace_equivalent(self.get_finalized_command("build_py"), ext)[0]
        cached = _cached(record)
        candidates = [path] + ([inplace] if self.editable_mode and inplace != path else [])
        candidates += [cached] if cached else []
        for kernel in candidates:
            if _built_from(kernel, record):
                if kernel != path:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    shutil.copy2(kernel, path)
                    shutil.copy2(os.path.join(os.path.dirname(kernel), RECORD), record_path)
                where = f"taken from OPTIM_KERNEL_CACHE ({kernel})" if kernel == cached else f"{kernel} is up to date"
                print(f"optim: the fused CPU kernel {where} (same source, flags and jaxlib)", file=sys.stderr)
                _keep(path, cached)
                return
        _remove(path, record_path)   # built from other sources or against another jaxlib: never reused
        ext.include_dirs.append(headers)
        _compile_at_once(self.compiler)
        super().build_extension(ext)   # optional=True: a failed compile is reported and the install goes on
        with open(record_path, "w") as f:
            json.dump(record, f, indent=1)
        _keep(path, cached)

    def copy_extensions_to_source(self):
        """Editable installs: the kernel and its record beside the sources, or neither where none was built (a
        kernel left there by an earlier install is removed, and so are those named for one Python version)."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace, regular = self._get_inplace_equivalent(build_py, ext)
            folder = os.path.dirname(inplace)
            stale = [n for n in os.listdir(folder) if n.startswith("_fused_kernel.") and n.endswith(".so")]
            _remove(*(os.path.join(folder, n) for n in stale if n != os.path.basename(inplace)))
            if os.path.exists(regular):
                self.copy_file(os.path.join(os.path.dirname(regular), RECORD), os.path.join(folder, RECORD))
            else:
                _remove(inplace, os.path.join(folder, RECORD))


class Wheel(bdist_wheel):
    def get_tag(self):
        python, abi, plat = super().get_tag()
        # The kernel uses no Python symbol (see above): any Python 3 of requires-python, this platform.
        return (python, abi, plat) if self.root_is_pure else ("py3", "none", plat)


def _manylinux() -> tuple[list[str], list[tuple[str, str | None]], list[str]]:
    """`(sources, macros, link flags)` that keep the kernel within manylinux_2_28 (GLIBC_2.28, GLIBCXX_3.4.24),
    the platform of jaxlib's wheels, when it is built on a newer glibc and GCC (`auditwheel show` in
    tests/test_packaging.py checks it). libstdc++ is linked in statically: the system's libstdc++.so would need
    the toolchain's GLIBCXX version. libgcc stays shared: its static unwinder calls _dl_find_object (GLIBC_2.35).
    build_support/manylinux.cc stands in for the two newer glibc symbols libstdc++.a refers to, and the version
    script exports the kernel's entry points alone. Elsewhere (macOS, musl): nothing."""
    libc, version = platform.libc_ver()
    if not sys.platform.startswith("linux") or libc != "glibc":
        return [], [], []
    macros, link = [], ["-static-libstdc++", "-Wl,--version-script=build_support/kernel.map"]
    glibc = tuple(int(v) for v in re.findall(r"\d+", version)[:2])
    if glibc >= (2, 34) and platform.machine() in ("x86_64", "aarch64"):
        macros, link = [("OPTIM_WRAP_PTHREAD_ONCE", None)], link + ["-Wl,--wrap=pthread_once"]
    return ["build_support/manylinux.cc"], macros, link


_COMPAT_SOURCES, _COMPAT_MACROS, _COMPAT_LINK = _manylinux()

fused = Extension(
    KERNEL,
    # The handlers with the element loops for the baseline x86-64, and the loops for AVX2 and for AVX-512 (the
    # build that runs is chosen at load), and the one-pass quantised Adam step's handler, compiled at once
    # (`_compile_at_once`).
    sources=["optim/_engine/fused.cc", "optim/_engine/fused_avx2.cc", "optim/_engine/fused_avx512.cc",
             "optim/_engine/fused_quantized.cc", *_COMPAT_SOURCES],
    depends=["optim/_engine/fused.h", "optim/_engine/fused_loops.inc", "optim/_engine/fused_quantized.inc",
             "build_support/kernel.map"],
    define_macros=_COMPAT_MACROS,
    language="c++",
    # -fno-math-errno: sqrt without the errno branch, so the element loop vectorises. -fvisibility=hidden: only the
    # handler symbol is exported. -ffp-contract=off: no multiply-add contracted where AVX-512 has FMA, so every
    # instruction set's loops compute the same bits.
    extra_compile_args=["-std=c++17", "-O3", "-fno-math-errno", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
                        "-ffunction-sections", "-fdata-sections", "-ffp-contract=off", "-w"],
    # -s: no debug information or symbol table (Python's flags compile with -g: 3.3 MB, stripped 0.5 MB);
    # --gc-sections: unused functions dropped. On Linux, libstdc++ linked in (`_manylinux`).
    extra_link_args=["-s", "-Wl,--gc-sections", *_COMPAT_LINK],
    optional=True,
)

setup(ext_modules=[fused], cmdclass={"build_ext": BuildFused, "bdist_wheel": Wheel})
