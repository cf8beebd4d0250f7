"""Weight-only int8: `LLM(..., quantization="int8")`, `--quantization int8`.

What is quantised: every `Linear` of the model, swapped for an `Int8Linear` as soon as the loader
has filled it (loader.load_model: on CPU loading never holds the whole model-dtype model, memory
peaks near the int8 one; on a GPU the parameters are allocated when the model is built, so the peak
there is the model-dtype model; the checkpoint stays bf16/fp32 on disk): qkv_proj, o_proj,
gate_up_proj and down_proj of every layer, and the LM head. A tied head gets its own int8 copy; the
embedding lookup keeps the model-dtype matrix (it reads one row per token, so it costs memory but no
decode time). Norms, embeddings and biases stay in the model dtype, and so do activations and the KV
cache. Qwen3-MoE's experts (stacked [E, out, in] tensors) become `Int8Experts`: every expert's
matrix quantised and computed exactly as an Int8Linear of it would be. Its router stays exact (a
`Linear` named `gate`: tiny, and kept so that int8 noise does not change which experts a token goes
to, as vLLM does).

Numerics (symmetric, one scale per output row, no zero point), for W [out, in]:

    scale[o] = max_i |W[o, i]| / 127      computed in float32, then stored in the model dtype,
                                          rounded up there so that |W / scale| <= 127 (a zero row
                                          gets scale 1): at most one step of that dtype above (2^-7
                                          relative in bf16; in fp16, rows with max|W| < 7.8e-3 get a
                                          subnormal, coarser scale)
    Wq[o, i] = round(W[o, i] / scale[o])  int8 in [-127, 127] (-128 is never used), round half to
                                          even
    |W - Wq * scale| <= scale / 2         per element: about max|W[o]| / 254
    y = (x @ Wq.T) * scale + bias         int8 values convert exactly to bf16/fp16/fp32 (|Wq| <= 127
                                          fits an 8-bit significand); products accumulate in float32
                                          inside the kernels, the scale applies in float32, and the
                                          output is rounded to the activation dtype once

Kernels, chosen per call:
- CPU where nanoqwen's gemv kernels are on (ops/cpu/matmul.py: measured against torch's), up to 16 bf16
  rows (int8pack was slower at each row count), or up to the bf16 kernel's measured row count where
  that is higher: nanoqwen's own AVX2 kernel (ops/cpu/kernels.py `int8_gemv`), which streams the int8
  rows once for all the rows of x. It multiplies in integers: x rounded to int16 in blocks of 64
  (one float32 scale each: an error of at most 2^-16 of the block's largest value), int16 products summed
  in int32.
- CPU, few rows (decode), bf16/fp16 activations: `torch.ops.aten._weight_int8pack_mm`, which reads
  the int8 matrix directly: half the bytes of a bf16 matrix-vector product, so batch-1 decode runs
  faster. Its cost grows with every 4 rows while a bf16 matmul's barely grows, so above
  INT8PACK_MAX_ROWS rows (measured; see there) the matmul dequantises instead. The kernel needs a
  contiguous 2-D input, the scale in the input dtype and in_features % 16 == 0 (other widths crash
  the process in torch 2.13: they take the dequantise path). Its float32 path is much slower than
  its bf16 one, and slower than a float32 matmul: float32 models always dequantise (about the
  float32 model's speed, with a quarter of the weight bytes).
- CPU, more bf16 rows on the float32 path where nanoqwen's GEMM was chosen (ops/cpu/matmul.py): its int8
  version (ops/cpu/kernels.py `int8_gemm`), which converts the int8 weights to float32 while packing them:
  the same function as the kernels for few rows (float32 products and scaling, rounded once).
- Otherwise (prefill, float32 models, fp16, other devices): dequantise block by block,
  `F.linear(x, (Wq[rows] * scale[rows]).to(compute))`, with blocks of at most ops/cpu/matmul.py's
  UPCAST_BLOCK_BYTES on a CPU computing in float32 (so a big matrix, the LM head, never has a float32 copy
  in memory). In float32 this is the same function again; in bf16 (a CPU with fast bf16 matmuls: AMX,
  AVX-512 BF16) it multiplies by the weights rounded to bf16 (Wq * scale, rounded once), where the few-row
  kernels multiply by them exactly: a difference far below the output's own rounding, which can still flip
  a near-tie, so a request's int8 tokens may depend on whether its rows ran beside a prompt's (the
  consistency tests bound it). On a GPU nothing compiles this into one kernel: memory is saved, speed is
  not gained.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.layers.experts import Experts
from nanoqwen.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu.matmul import MatmulPath, linear_in_row_blocks
from nanoqwen.ops.quantize import quantize_weight
from nanoqwen.quantization.base import QuantizedLinear, block_rows

# int8pack's cost grows every 4 rows while a bf16 matmul's barely does, so above this many rows
# (tokens) the dequantise path is faster on CPU (bench/bench_gemv.py measures both).
INT8PACK_MAX_ROWS = 16


class Int8Linear(QuantizedLinear):
    """y = (x @ weight.T) * scale + bias with an int8 `weight` [out, in] and a per-row `scale` [out]
    (model dtype). Named like `Linear` (weight [out, in]), so whatever slices a Linear's rows or
    columns can slice this one's the same way (scale goes with the rows)."""

    BUFFERS = ("weight", "scale")

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_weight(weight)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel = pick_kernel(x, self.in_features, self.matmul_path, self.weight.shape[0])
        y = kernel(x, self.weight, self.scale.to(x.dtype))
        return y if bias is None else y + bias


class Int8ColumnParallelLinear(Int8Linear, ColumnParallelLinear):
    """Int8Linear's matmul in a ColumnParallelLinear."""


class Int8RowParallelLinear(Int8Linear, RowParallelLinear):
    """Int8Linear's matmul in a RowParallelLinear (whose forward adds the ranks' parts)."""


INT8_VERSIONS: dict[type[Linear], type[QuantizedLinear]] = {
    Linear: Int8Linear, ColumnParallelLinear: Int8ColumnParallelLinear,
    RowParallelLinear: Int8RowParallelLinear}
Int8Linear.VERSIONS = INT8_VERSIONS


class Int8Experts(Experts):
    """Qwen3-MoE experts with int8 matrices: buffers gate_up_proj [E, 2Ie, H] and down_proj
    [E, H, Ie] (int8), gate_up_proj_scale [E, 2Ie] and down_proj_scale [E, H] (one scale per row of
    each expert, model dtype). Expert e's matrix is quantised as Int8Linear quantises a matrix, and
    each expert's matmul picks its kernel the same way (int8pack for up to INT8PACK_MAX_ROWS tokens
    on CPU, else dequantise): Experts.forward's grouping is unchanged, only `expert_linear` reads
    int8.
    """

    def __init__(self, experts: Experts) -> None:
        nn.Module.__init__(self)  # not Experts.__init__: no model-dtype parameters to allocate
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(experts, name)  # [E, out, in]
            # the experts' rows, one after another
            q, scale = quantize_weight(w.reshape(-1, w.shape[-1]))
            self.register_buffer(name, q.view(w.shape))
            self.register_buffer(f"{name}_scale", scale.view(w.shape[:2]))
        self.matmul_path = experts.matmul_path

    def expert_linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        q, scale = getattr(self, name)[e], getattr(self, f"{name}_scale")[e]
        return pick_kernel(x, q.shape[1], self.matmul_path, q.shape[0])(x, q, scale.to(x.dtype))


def int8pack_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(x @ q.T) * scale through the CPU kernel that reads int8 weights directly (see
    int8pack_supported)."""
    in_features = q.shape[1]
    rows = x.numel() // in_features
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, in_features).contiguous(), q, scale)
    return y.view(*x.shape[:-1], q.shape[0])


def int8pack_supported(dtype: torch.dtype, in_features: int) -> bool:
    """Whether the CPU int8pack kernel takes (and is fast for) this input: bf16/fp16,
    in_features % 16 == 0."""
    return dtype in (torch.bfloat16, torch.float16) and in_features > 0 and in_features % 16 == 0


def dequantized_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                       compute: torch.dtype | None = None) -> torch.Tensor:
    """x @ (q * scale).T, the weights dequantised to the compute dtype (x's by default) in row blocks
    (block_rows): the scale is applied to the weights, in float32, so the product is rounded once, as the
    kernels that read int8 weights round it."""
    out_features, in_features = q.shape
    xc = x.to(compute or x.dtype)

    def product(start: int, end: int) -> torch.Tensor:
        # (Wq * scale rounds once in the compute dtype: Wq is exact there, the product of the two rounded)
        return F.linear(xc, q[start:end].to(xc.dtype) * scale[start:end].to(xc.dtype)[:, None])

    return linear_in_row_blocks(x, out_features, block_rows(xc, in_features), product)


def dequantized_linear_float32(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dequantized_linear computed in float32 and rounded to x's dtype once (a CPU whose bf16 matmuls are slow:
    MatmulPath.upcast_16bit)."""
    return dequantized_linear(x, q, scale, torch.float32)


def pick_kernel(x: torch.Tensor, in_features: int, path: MatmulPath, out_features: int = 0
                ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The kernel for this input on this matmul path: nanoqwen's int8 kernels where the path gives them the
    rows (AMX tiles for a matrix of out_features rows where chosen), int8pack for few rows on CPU, dequantise
    otherwise (module docstring)."""
    dequantized = dequantized_linear_float32 if path.upcast_16bit(x) else dequantized_linear
    if x.device.type != "cpu":
        return dequantized
    if path.int8_amx_rows(x, in_features, out_features):  # batched decode steps, where measured faster
        return cpu_kernels.int8_amx
    if path.int8_gemv_rows(x):  # where nanoqwen's gemv kernels are on: its own kernel reads the int8 rows
        return cpu_kernels.int8_gemv
    if path.own_gemm(x):  # more rows, where nanoqwen's GEMM was chosen (float32 path): its int8 version
        return cpu_kernels.int8_gemm
    rows = x.numel() // in_features if in_features else 0
    if rows <= INT8PACK_MAX_ROWS and int8pack_supported(x.dtype, in_features):
        return int8pack_linear
    return dequantized
