"""The kernels an engine builds its model with (`Kernels`, nanoqwen/models/qwen3.py), chosen once from its
device, dtype and options and this CPU's measurements: torch.compile for the model's elementwise math
(RMSNorm, RoPE, SwiGLU), nanoqwen's C++ versions of them for few rows, and the CPU's matmul path
(nanoqwen/ops/cpu/selection.py). `select_kernels` returns the choice; the engine passes it to the model
when it builds it, so two engines in one process each compute with their own.

In eager PyTorch each elementwise function is 5-8 separate passes over memory (cast, square, mean, rsqrt,
multiply, cast back, ...); compiled, each becomes one fused kernel (C++/OpenMP; used on CPU only). Not on
CPUs whose bf16 matmuls are slow (the float32 path, AVX2 only): there inductor's bf16 code moves 8 elements
at a time through a temporary buffer (torch's 256-bit bf16 vector holds 16, and a partial load is a memcpy),
and the compiled SwiGLU and RoPE are slower than the plain ops (bench/bench_model.py measures prefill both
ways), so those CPUs run eager. Matmuls and attention stay on their own kernels, and the plain functions
stay the reference the compiled ones are tested against.

A compiled call costs tens of microseconds of guard checks before its kernel runs, more than the eager ops
cost for the few tokens of a decode step, so the compiled versions are used only for calls with at least
`MIN_COMPILED_TOKENS` tokens (prompt chunks, big batches); smaller calls run the plain functions, or, where
nanoqwen's own CPU kernels are on, their one-call C++ versions (nanoqwen/ops/cpu/kernels.py) for bf16.
Where nothing is compiled and those kernels are on (the float32 path, or enforce_eager), the C++ versions
take bf16 calls of every size: one pass each, shared by the threads, against the plain functions' 5-8
(bench/bench_decode_step.py).

Compiled functions are made once per (device, dtype) in a process and shared by the engines that choose them
(a compiled function of the same plain function is the same kernel); compilation falls back to eager with a
warning when it is not available (no C++ compiler, an unsupported platform).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

from nanoqwen.models import qwen3
from nanoqwen.models.qwen3 import Kernels
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu.cpu_info import cpu_name_and_flags, isa_summary
from nanoqwen.ops.cpu.matmul import TORCH_MATMUL
from nanoqwen.ops.cpu.selection import select_matmul_path

logger = logging.getLogger("nanoqwen")
FUNCTIONS = ("rms_norm", "apply_rope", "swiglu")
MIN_COMPILED_TOKENS = 64
Function = Callable[..., torch.Tensor]


def select_kernels(device: torch.device, dtype: torch.dtype, enforce_eager: bool) -> Kernels:
    """The engine's kernels (each tensor-parallel rank makes the same choice).

    Matmuls: on a CPU, 16-bit models take this CPU's measured matmul path (select_matmul_path); elsewhere
    torch's own. Elementwise: the compiled functions on CPU, except with enforce_eager and on the float32
    matmul path, else the plain ones (nanoqwen's C++ ones for bf16 where its kernels are on).
    """
    matmul = TORCH_MATMUL
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        matmul = select_matmul_path()
    if device.type != "cpu":
        return Kernels(matmul=matmul)
    few = _eager_functions(own_kernels=matmul.gemv)
    compiled = None
    if not enforce_eager and matmul.path != "float32":
        compiled = compiled_functions(device.type, dtype)
    if compiled is None:
        return Kernels(**few, matmul=matmul)
    return Kernels(**{name: CompiledBySize(few[name], compiled[name]) for name in FUNCTIONS}, matmul=matmul)


def describe_kernels(kernels: Kernels, device: torch.device, dtype: torch.dtype, enforce_eager: bool = False,
                     quantization: str | None = None) -> str:
    """One line saying what the engine computes with (the log's `kernels:` line, `nanoqwen bench`)."""
    if device.type != "cpu":
        return f"{device.type}: torch's kernels"
    name, flags = cpu_name_and_flags()
    matmul = kernels.matmul
    compiled = isinstance(kernels.rms_norm, CompiledBySize)
    elementwise = "compiled elementwise kernels" if compiled else "eager elementwise ops"
    if matmul.path == "float32" and not enforce_eager:
        elementwise += " (faster than compiled ones where bf16 matmuls are slow)"
    if matmul.gemv and dtype == torch.bfloat16:
        elementwise += ("; decode steps: nanoqwen's C++ RMSNorm/RoPE/SwiGLU and paged attention, "
                        "all decoder layers in one call where the model allows")
    line = f"{name} ({isa_summary(flags)}): "
    line += (matmul.describe() if dtype != torch.float32 else "float32 matmuls") + f"; {elementwise}"
    if quantization == "int4" and cpu_kernels.available():
        line += (f"; int4 rows: int8 activations, {cpu_kernels.int4_dot_instructions()} integer dot "
                 f"products (up to 8 rows streamed, more on unpacked weight panels)")
    return line


class CompiledBySize:
    """The compiled function for calls on many tokens (x [N, ...] first: N >= MIN_COMPILED_TOKENS), `few`
    for the others."""

    def __init__(self, few: Function, compiled: Function) -> None:
        self.few, self.compiled = few, compiled

    def __call__(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        use = self.compiled if x.shape[0] >= MIN_COMPILED_TOKENS else self.few
        return use(x, *args)


def _eager_functions(own_kernels: bool) -> dict[str, Function]:
    """The plain functions, or (own_kernels) nanoqwen's C++ versions for bf16 CPU tensors (the plain ones are
    their reference and take every other tensor)."""
    plain = {name: getattr(qwen3, name) for name in FUNCTIONS}
    if not own_kernels:
        return plain
    return {name: _for_bf16_cpu(getattr(cpu_kernels, name), plain[name]) for name in FUNCTIONS}


def _for_bf16_cpu(fast: Function, reference: Function) -> Function:
    def kernel(x: torch.Tensor, *args: object) -> torch.Tensor:
        use = fast if x.dtype == torch.bfloat16 and x.device.type == "cpu" else reference
        return use(x, *args)
    return kernel


@functools.cache
def compiled_functions(device_type: str, dtype: torch.dtype) -> dict[str, Function] | None:
    """The model's elementwise functions through torch.compile, warmed up at MIN_COMPILED_TOKENS tokens (the
    smallest calls that use them), so compilation happens at load time, not on a user's request; None where
    torch.compile does not work here. Made once per (device, dtype) in a process, dynamic shapes."""
    if device_type == "cpu":
        _inductor_cache_per_cpu_capability()
    # one compiled graph per (dtype, rank of x): allow more than dynamo's default of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = {name: torch.compile(getattr(qwen3, name), dynamic=True) for name in FUNCTIONS}
    n, device = MIN_COMPILED_TOKENS, torch.device(device_type)
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


def _inductor_cache_per_cpu_capability() -> None:
    """One torch.compile disk cache per torch CPU capability, unless the user chose another folder
    than the default one (TORCHINDUCTOR_CACHE_DIR). The default folder is shared by every process
    of the user, and a CPU kernel compiled under one capability was reused under another: on an
    AVX-512 CPU, processes limited with ATEN_CPU_CAPABILITY=avx2 after unlimited ones got NaN from
    the compiled RMSNorm; with a fresh folder, never."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()  # (importing torch._dynamo already sets the variable to it)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        capability = torch.backends.cpu.get_cpu_capability().lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-{capability}"
