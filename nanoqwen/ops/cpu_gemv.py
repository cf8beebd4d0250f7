"""Matrix-vector kernels for CPU decode: bf16 and int8 weights times a few rows of bf16 activations.

Decoding one token (or a handful of sequences) multiplies each weight matrix by 1..8 activation rows. Each
weight is then used only a few times, so the product is bound by how fast the weights stream from memory, and
a good kernel reads them at close to the machine's read bandwidth. On CPUs without native bf16 instructions
(AVX2-only: AMD Zen, most Intel client chips) torch's bf16 `F.linear` and its weight-only int8 kernel
(`torch.ops.aten._weight_int8pack_mm`) are far from that: they are built for many rows, and for one row they
spend their time converting and reshuffling rather than reading.

The kernels in csrc/cpu_gemv.cpp do the simple thing, as llama.cpp and vLLM do for this case: each weight row
is read once, widened to float32 in AVX2 registers, multiplied with all rows of x with FMA into several
float32 accumulators, and each output is rounded to bf16 once. Threads split the output rows. They compute
exactly what `bf16_gemv_reference` and `int8_gemv_reference` below compute, up to the order of float32
additions (tests/test_cpu_gemv.py checks this; bench/bench_gemv.py measures the speed).

The extension is compiled on first use with torch.utils.cpp_extension (a C++ compiler is needed; the build
is cached in torch's extensions folder under a name that hashes the source and flags, so an edit rebuilds).
`available()` says whether the kernels can be used: False where NANOQWEN_CPU_GEMV=0 (read until the kernels
are loaded), where the CPU lacks AVX2/FMA, or where the build fails (one warning with the reason, then False
for the rest of the process).

Inputs: x bf16 [..., K] (any leading shape, M = their product; groups of 8 rows re-read the weights, so the
kernels are meant for M <= 8), weights bf16 / int8 [N, K], bias / scale bf16 [N], all on the CPU.
Non-contiguous inputs are copied to contiguous ones first (correct, but a copied weight costs an extra pass);
other dtypes, devices or shapes raise RuntimeError with a message naming the argument.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from nanoqwen.ops.cpu import cpu_name_and_flags

logger = logging.getLogger("nanoqwen")
SOURCE = Path(__file__).parent / "csrc" / "cpu_gemv.cpp"
ENV = "NANOQWEN_CPU_GEMV"  # "0" disables the kernels (no build)

_lock = threading.Lock()
_ext: ModuleType | None = None  # the built extension, once available() succeeded
_failure: str | None = None  # why it is not available, once that is known (warned about once)


def bf16_gemv_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What bf16_gemv computes: x @ w.T + bias in float32, rounded to bf16 once."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(torch.bfloat16)


def int8_gemv_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What int8_gemv computes: (x @ q.T) * scale in float32, rounded to bf16 once."""
    return (F.linear(x.float(), q.float()) * scale.float()).to(torch.bfloat16)


def bf16_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T + bias for bf16 x [..., K], w [N, K], bias [N]; y bf16 [..., N]. Needs available()."""
    if _ext is None:
        _require()
    if x.dim() == 2:  # the common case, kept free of Python-side tensor ops (each costs microseconds)
        return _ext.bf16_gemv(x, w, bias)
    return _ext.bf16_gemv(x.reshape(-1, x.shape[-1]), w, bias).view(*x.shape[:-1], w.shape[0])


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = (x @ q.T) * scale for bf16 x [..., K], int8 q [N, K], bf16 scale [N]; y bf16 [..., N]."""
    if _ext is None:
        _require()
    if x.dim() == 2:
        return _ext.int8_gemv(x, q, scale)
    return _ext.int8_gemv(x.reshape(-1, x.shape[-1]), q, scale).view(*x.shape[:-1], q.shape[0])


def _require() -> None:
    if not available():
        reason = f"{ENV}=0" if os.environ.get(ENV, "1") == "0" else _failure
        raise RuntimeError(f"nanoqwen's CPU gemv kernels are not available ({reason})")


def available() -> bool:
    """Whether the kernels can run here; builds them on the first call (seconds to a minute, then cached)."""
    global _ext, _failure
    if _ext is not None:
        return True
    if os.environ.get(ENV, "1") == "0":
        return False
    if _failure is not None:
        return False
    with _lock:
        if _ext is None and _failure is None:
            try:
                _ext = _build()
            except Exception as e:  # no compiler, no AVX2, a compile error: stay correct on torch's kernels
                first_line = (str(e).strip().splitlines() or [""])[0][:300]
                _failure = f"{type(e).__name__}: {first_line}"
                logger.warning("nanoqwen's CPU gemv kernels are not available (%s); using torch's matmuls", _failure)
    return _ext is not None


def compile_flags() -> list[str]:
    """-O3, OpenMP and the ISA flags this CPU reports (the kernels need AVX2 and FMA; F16C where present).

    -fopenmp matters: at::parallel_for is a header template that runs on OpenMP threads only when the
    extension itself is compiled with OpenMP (else it silently runs on one thread). The extension then uses
    the libgomp torch has already loaded, so torch.set_num_threads governs it too."""
    _, flags = cpu_name_and_flags()
    missing = [f for f in ("avx2", "fma") if f not in flags]
    if missing:
        raise RuntimeError(f"this CPU lacks {' and '.join(missing).upper()} (or /proc/cpuinfo is unreadable)")
    return ["-O3", "-fopenmp", "-mavx2", "-mfma"] + (["-mf16c"] if "f16c" in flags else [])


def _build() -> ModuleType:
    from torch.utils import cpp_extension  # imported here: it pulls in setuptools, needed only to build

    cflags = compile_flags()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(cflags).encode()).hexdigest()[:12]
    ext = cpp_extension.load(name=f"nanoqwen_cpu_gemv_{digest}", sources=[str(SOURCE)], extra_cflags=cflags,
                             extra_ldflags=["-fopenmp"], verbose=False)
    if not ext.has_avx2():
        raise RuntimeError("the extension was built without AVX2/FMA")
    return ext
