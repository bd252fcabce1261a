"""Small C kernels of the CPU backend, built with the machine's C compiler and loaded with ctypes.

`kernel(source, symbol, argtypes, restype)` builds a C file of this folder (-O3 -march=native; a
fraction of a second) into ~/.cache/hybridserve/native, keyed by the source, the compiler, the flags and
the CPU's feature flags, and returns its function `symbol` with its ctypes signature, once per process;
it returns None (the caller keeps its torch form) where no compiler or build works. A concurrent build by
another process is harmless: each writes a file of its own and renames it into place.
The kernels: ssm_update.c (the decode programs' SSM state in place) and logit_stats.c (the sampler's
argmax and log-normaliser)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from gpu_worker.model.backends.cpu.compiled_decode import hybridserve_cache

log = logging.getLogger("hybridserve.worker.native")
COMPILERS = ("cc", "gcc", "clang", "c++", "g++", "clang++")
FLAGS = ("-x", "c", "-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, source: Path) -> Path:
    """The shared library of `source` for `compiler`, built once per key."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join((source.read_text(), compiler, version, " ".join(FLAGS), platform.machine(), _cpu_flags())).encode()
    ).hexdigest()[:16]
    folder = hybridserve_cache("native") or Path(tempfile.gettempdir()) / "hybridserve-native"
    target = folder / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", scratch, str(source)], check=True, capture_output=True, timeout=120)
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target


@functools.cache
def kernel(source: Path, symbol: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    """`source` built and loaded once per process (module docstring), its function `symbol` typed
    `argtypes` -> `restype`; None where it cannot be built."""
    compiler = next((c for c in COMPILERS if shutil.which(c)), None)
    if compiler is None:
        log.info("no C compiler: %s's kernel stays in torch", source.stem)
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler, source)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("the %s kernel did not build (%s %s): its torch form stays", source.stem, exc,
                    detail.decode(errors="replace")[-500:])  # fmt: skip
        return None
    function = getattr(library, symbol)
    function.argtypes, function.restype = list(argtypes), restype
    return function
