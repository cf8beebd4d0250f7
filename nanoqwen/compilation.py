"""The kernels an engine selects for the layers (`models.qwen3.kernels`): torch.compile for the
model's elementwise math (RMSNorm, RoPE, SwiGLU), and, on CPUs whose bf16 matmuls are slow, the
float32 matmul path of nanoqwen/ops/cpu.py (`select_kernels`).

In eager PyTorch each of these is 5-8 separate passes over memory (cast, square, mean, rsqrt,
multiply, cast back, ...); compiled, each becomes one fused kernel (C++/OpenMP; used on CPU only).
On the 2-core development machine with native bf16 that made prefill faster (BENCHMARKS.md). Not
on CPUs whose bf16 matmuls are slow (AVX2 only): there inductor's bf16 code moves 8 elements at a
time through a temporary buffer (torch's 256-bit bf16 vector holds 16, and a partial load is a
memcpy), and the compiled SwiGLU and RoPE took 6.8x and 4.7x the plain ops' time on a 512-token
prompt, so the engine runs those CPUs eager (`select_kernels`). Matmuls and attention
stay on torch's own kernels, and the plain functions in models/qwen3.py stay the reference the
compiled ones are tested against.

A compiled call costs tens of microseconds of guard checks before its kernel runs, more than the
eager ops cost for the few tokens of a decode step, so the compiled versions are used only for calls
with at least `MIN_COMPILED_TOKENS` tokens (prompt chunks, big batches); smaller calls run the plain
functions, or, where nanoqwen's own CPU kernels are on (ops/cpu.py), their one-call C++ versions
(ops/cpu_gemv.py) for bf16. Where nothing is compiled and those kernels are on (the float32 path of
CPUs without fast bf16, or enforce_eager), the C++ versions take bf16 calls of every size: one pass
each, shared by the threads, against the plain functions' 5-8 (BENCHMARKS.md).

The switch is process-wide (the layers call `models.qwen3.kernels`), compiles once per process with
dynamic shapes, and falls back to eager with a warning when compilation is not available (no C++
compiler, an unsupported platform).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoqwen.models import qwen3
from nanoqwen.ops import cpu, cpu_probes

logger = logging.getLogger("nanoqwen")
FUNCTIONS = ("rms_norm", "apply_rope", "swiglu")
MIN_COMPILED_TOKENS = 64
# (device, dtype) -> kernels
_compiled: dict[tuple[str, str], dict[str, Callable[..., torch.Tensor]] | None] = {}
# (device, dtype, own_kernels) -> the kernels installed
_by_size_kernels: dict[tuple[str, str, bool], dict[str, Callable[..., torch.Tensor]]] = {}


def compile_kernels(device: torch.device, dtype: torch.dtype, own_kernels: bool = False) -> bool:
    """Route the layers' elementwise functions through torch.compile; True if that worked (else the
    plain ones). own_kernels: calls on few bf16 tokens take ops/cpu_gemv.py's C++ versions.

    Compiled and warmed up once per (device, dtype) at MIN_COMPILED_TOKENS tokens, the smallest
    calls that use them, so compilation happens at load time, not on a user's request.
    """
    key = (device.type, str(dtype))
    if key not in _compiled:
        _compiled[key] = _compile(device, dtype)
    compiled = _compiled[key]
    if (*key, own_kernels) not in _by_size_kernels:  # (made once: an engine reinstalls the same)
        few = _eager_kernels(own_kernels)
        _by_size_kernels[(*key, own_kernels)] = {
            name: _by_size(few[name], compiled[name]) if compiled else few[name]
            for name in FUNCTIONS}
    _install(_by_size_kernels[(*key, own_kernels)])
    return compiled is not None


def _inductor_cache_per_cpu_capability() -> None:
    """One torch.compile disk cache per torch CPU capability, unless the user chose another folder
    than the default one (TORCHINDUCTOR_CACHE_DIR). The default folder is shared by every process
    of the user, and a CPU kernel compiled under one capability was reused under another: on an
    AVX-512 CPU, processes limited with ATEN_CPU_CAPABILITY=avx2 after unlimited ones got NaN from
    the compiled RMSNorm (tests/test_cpu_path.py and the int8 quality tests, run under those
    limits); with a fresh folder, never."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()  # (importing torch._dynamo already sets the variable to it)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        capability = torch.backends.cpu.get_cpu_capability().lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-{capability}"


def _compile(device: torch.device, dtype: torch.dtype
             ) -> dict[str, Callable[..., torch.Tensor]] | None:
    if device.type == "cpu":
        _inductor_cache_per_cpu_capability()
    # one compiled graph per (dtype, rank of x): allow more than dynamo's default of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = {name: torch.compile(getattr(qwen3, name), dynamic=True) for name in FUNCTIONS}
    n = MIN_COMPILED_TOKENS
    try:
        with torch.inference_mode():
            x = torch.randn(n, 2, 8, device=device, dtype=dtype)
            cos_sin = torch.randn(n, 8, device=device, dtype=dtype)
            compiled["rms_norm"](x, torch.ones(8, device=device, dtype=dtype), 1e-6)
            compiled["rms_norm"](x.view(n, 16), torch.ones(16, device=device, dtype=dtype), 1e-6)
            compiled["apply_rope"](x, cos_sin, cos_sin)
            compiled["swiglu"](x.view(n, 16))
    except Exception as e:
        # inductor raises many kinds (no compiler, codegen failure): stay correct, eager
        logger.warning("torch.compile is not available here (%s: %s); running eager. "
                       "Pass enforce_eager=True (--enforce-eager) to skip this attempt.",
                       type(e).__name__, str(e).splitlines()[0][:200])
        return None
    return compiled


def _eager_kernels(own_kernels: bool) -> dict[str, Callable[..., torch.Tensor]]:
    """The plain functions, or (own_kernels) ops/cpu_gemv.py's versions for bf16 CPU tensors (the reference for
    the others)."""
    plain = {name: getattr(qwen3, name) for name in FUNCTIONS}
    if not own_kernels:
        return plain
    from nanoqwen.ops import cpu_gemv

    def own(name: str) -> Callable[..., torch.Tensor]:
        fast, reference = getattr(cpu_gemv, name), plain[name]

        def kernel(x: torch.Tensor, *args: object) -> torch.Tensor:
            use = fast if x.dtype == torch.bfloat16 and x.device.type == "cpu" else reference
            return use(x, *args)
        return kernel
    return {name: own(name) for name in FUNCTIONS}


def _install(kernels: dict[str, Callable[..., torch.Tensor]]) -> None:
    for name, fn in kernels.items():
        setattr(qwen3.kernels, name, fn)


def _by_size(few: Callable[..., torch.Tensor], compiled: Callable[..., torch.Tensor]
             ) -> Callable[..., torch.Tensor]:
    """The compiled function for calls on many tokens (x [N, ...] first), `few` for the others."""
    def kernel(x: torch.Tensor, *args: object) -> torch.Tensor:
        many = x.shape[0] >= MIN_COMPILED_TOKENS
        use = kernel.compiled if many else few  # type: ignore[attr-defined]
        return use(x, *args)
    kernel.compiled = compiled  # type: ignore[attr-defined]
    return kernel


def select_kernels(device: torch.device, dtype: torch.dtype, enforce_eager: bool) -> str:
    """The engine's choice for this process (each tensor-parallel rank makes the same), and a line
    saying it.

    Elementwise: the compiled functions on CPU, except with enforce_eager and on the float32 matmul
    path, else the plain ones (nanoqwen's C++ ones for bf16 where its kernels are on).
    Matmuls: on a CPU whose bf16 matmuls are slow, 16-bit products over many rows compute in float32
    (nanoqwen/ops/cpu.py).
    """
    path = cpu.MatmulPath("bf16", "native")
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        path = cpu.select_matmul_path()
    cpu.use_matmul_path(path)
    qwen3.kernels.linear = cpu.linear if path.path == "float32" or path.gemv else F.linear
    compiled = False
    if device.type == "cpu" and not enforce_eager and path.path != "float32":
        compiled = compile_kernels(device, dtype, own_kernels=path.gemv)
    elif device.type == "cpu" and path.gemv:  # the C++ functions for bf16 calls of every size
        _install(_eager_kernels(True))
    else:
        # (a GPU engine after a CPU one in the same process must not keep the CPU's compiled
        # kernels)
        use_eager_kernels()
    if device.type != "cpu":
        return f"{device.type}: torch's kernels"
    name, flags = cpu_probes.cpu_name_and_flags()
    elementwise = "compiled elementwise kernels" if compiled else "eager elementwise ops"
    if path.path == "float32" and not enforce_eager:
        elementwise += " (faster than compiled ones where bf16 matmuls are slow)"
    if path.gemv and dtype == torch.bfloat16:
        elementwise += ("; decode steps: nanoqwen's C++ RMSNorm/RoPE/SwiGLU and paged attention, "
                        "all decoder layers in one call where the model allows")
    matmul = path.describe() if dtype != torch.float32 else "float32 matmuls"
    return f"{name} ({cpu_probes.isa_summary(flags)}): {matmul}; {elementwise}"


def use_eager_kernels() -> None:
    """Back to the plain functions (the reference), for every model in this process; forget what was
    compiled."""
    _install({name: getattr(qwen3, name) for name in FUNCTIONS})
    _compiled.clear()
    _by_size_kernels.clear()
