"""How nanoqwen's CPU kernels (csrc/) are compiled and cached: ops/cpu/kernels.py calls `build` once, on first use.

torch.utils.cpp_extension compiles csrc/*.cpp with -O3, OpenMP and this CPU's ISA flags (compile_flags) into a
folder of torch's extensions folder named by a hash of the sources and flags (build_directory, build_digest): an
edit, or another CPU's flags, builds anew; an unchanged one loads the cached build in a second. A C++ compiler is
needed. Two processes starting at once share one build through torch's lock file in that folder; a build killed
midway leaves the lock behind, removed after STALE_LOCK_SECONDS (clear_stale_lock) so that no later start hangs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from nanoqwen.ops.cpu.cpu_info import cpu_name_and_flags

logger = logging.getLogger("nanoqwen")
SOURCE_DIR = Path(__file__).parent / "csrc"  # cpu_kernels.h lists what each file holds
# A build takes 1-3 minutes on 2 cores; a lock file older than this was left by a build that died
STALE_LOCK_SECONDS = 600


def compile_flags() -> list[str]:
    """-O3, OpenMP and the ISA flags this CPU reports (the kernels need AVX2 and FMA; F16C where present;
    AVX-512 VNNI, one instruction for int4_gemv's 32-element integer dot products, and AVX-512 BF16, one for
    bf16_gemv's 16 bf16 products, where present and the CPU is not limited to AVX2 with
    ATEN_CPU_CAPABILITY=avx2, as when measuring an AVX2-only CPU's speed).

    -fopenmp matters: at::parallel_for is a header template that runs on OpenMP threads only when the
    extension itself is compiled with OpenMP (else it silently runs on one thread). The extension then uses
    the libgomp torch has already loaded, so torch.set_num_threads governs it too."""
    _, flags = cpu_name_and_flags()
    missing = [f for f in ("avx2", "fma") if f not in flags]
    if missing:
        raise RuntimeError(f"this CPU lacks {' and '.join(missing).upper()} (or /proc/cpuinfo is unreadable)")
    cflags = ["-O3", "-fopenmp", "-mavx2", "-mfma"] + (["-mf16c"] if "f16c" in flags else [])
    if "avx512vl" in flags and not limited_to_avx2():  # AVX-512 instructions on 256-bit vectors, where the CPU has them
        cflags += ["-mavx512vl"] + [f"-mavx512{isa}" for isa in ("vnni", "bf16") if f"avx512_{isa}" in flags]
    return cflags


def limited_to_avx2() -> bool:
    """Whether this process measures an AVX2-only CPU's speed (ATEN_CPU_CAPABILITY=avx2 or default): the kernels are
    then built without AVX-512 and run without AMX tiles."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("default", "avx2")


def build_digest() -> str:
    """A hash of the kernels' source and compile flags: names the build, and keys the speeds measured with it."""
    digest = hashlib.sha256(" ".join(compile_flags()).encode())
    for path in sorted(SOURCE_DIR.glob("*.[ch]*")):  # the .cpp files and the header they share
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def build_directory() -> Path:
    """Where this build of the kernels lives: torch's extensions folder (TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions), nanoqwen/<Python and torch versions>/<name with the build digest>. The
    versions are in the path because a build links against one Python and one torch: another venv's
    must not load it."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    versions = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return Path(root) / "nanoqwen" / versions / f"nanoqwen_cpu_kernels_{build_digest()}"


def clear_stale_lock(folder: Path) -> None:
    """Wait for another process's build of the same kernels (its lock file in the folder), but at most
    STALE_LOCK_SECONDS from the lock's creation: a build killed midway (Ctrl-C, a timeout) leaves its
    lock behind, and torch would wait for it forever, hanging every later start. Such a lock is removed,
    with a warning."""
    lock = folder / "lock"
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # the other build just finished
            return
        if age > STALE_LOCK_SECONDS:
            logger.warning("removing %s, left %.0f s ago by a build of nanoqwen's CPU kernels that did not "
                           "finish (killed?); building again", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)


def build(source_dir: Path = SOURCE_DIR, folder: Path | None = None) -> ModuleType:
    """The extension: compiled from source_dir's .cpp files with compile_flags() into folder (build_directory()),
    or loaded from there when that build exists; raises whatever the compiler or the loader raised. The module is
    named after the folder, so two builds in other folders (bench/ab_kernels.py's versions) load side by side."""
    from torch.utils import cpp_extension  # imported here: it pulls in setuptools, needed only to build

    sources = sorted(str(path) for path in source_dir.glob("*.cpp"))
    folder = folder or build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(folder)
    ext = cpp_extension.load(name=folder.name, sources=sources, build_directory=str(folder),
                             extra_cflags=compile_flags(), extra_ldflags=["-fopenmp"], verbose=False)
    if not ext.has_avx2():
        raise RuntimeError("the extension was built without AVX2/FMA")
    return ext
