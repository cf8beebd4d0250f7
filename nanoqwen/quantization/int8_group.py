"""Weight-only int8 with a scale (and an offset) per group of inputs: the format that holds a GGUF file's Q8_0,
Q5_0, Q5_1, Q5_K and Q6_K matrices exactly (nanoqwen/quantization/prequantized.py; the unpacking:
nanoqwen/ops/gguf_quants.py).

For W [out, in] in groups of G consecutive inputs of a row (G = 32, or 16 for Q6_K):

    W[o, i] = q[o, i] * scale[o, g] + offset[o, g]     g = i // G; q int8 (the 5-bit types' 0..31 included),
                                                       scale and offset float32 (offset absent for the
                                                       symmetric types: Q8_0, Q5_0, Q6_K)
    y = x @ W.T + bias                                 products accumulate in float32, the output rounds to
                                                       the activation dtype once

The scales stay float32 because the file's are float16 times a small integer (exact in float32, not in bf16):
nanoqwen computes with the file's own weights. Bytes per weight: 1 + 4 / G (+ 4 / G with an offset). Q6_K's come in
two levels, as the file holds them: an int8 `scale` a group of 16 and a float32 `super_scale` per 16 groups (a
group's scale is their product, exact in float32), and its values at 6 bits (`weight` uint8 [out, 3 in / 4],
ops/quantize.py pack_int6): 6 + 0.5 + 0.125 bits a weight (6.625, not 10; the file's 6.5625).

Kernels: for up to 16 bf16 rows on a CPU with nanoqwen's kernels (decode), `int8_group_gemv`
(ops/cpu/kernels.py): x rounded to int16 per group (as int8_gemv rounds it per 64), integer dot products per
group, each scaled in float32 (int8_group_gemv_reference there is its definition). Otherwise (prompts, other
dtypes and devices) the matrix is dequantised row block by row block to the compute dtype and multiplied
there (`int8_group_dequantized_linear`, plain torch: the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu.matmul import MatmulPath, linear_in_row_blocks
from nanoqwen.ops.quantize import dequantize_int8_group
from nanoqwen.quantization.base import QuantizedLinear, block_rows

GEMV_MAX_ROWS = 16  # rows of x the kernel takes; more dequantise (a prompt: the dequantised product is faster)


class Int8GroupLinear(QuantizedLinear):
    """y = x @ W.T + bias with W = q * scale + offset per group: `weight` int8 [out, in], `scale` and `offset`
    float32 [out, in/G] (`offset` None for a symmetric type), or two levels: `scale` int8 with `super_scale`
    float32 [out, in/(16G)] (Q6_K); see the module docstring."""

    BUFFERS = ("weight", "scale", "offset", "super_scale")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 super_scale: torch.Tensor | None = None, bias: nn.Parameter | None = None) -> None:
        nn.Module.__init__(self)
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)  # (None: not a buffer, not in the state dict)
        self.register_buffer("super_scale", super_scale)
        self.bias = bias

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * 4 // 3 if self.weight.dtype == torch.uint8 else self.weight.shape[1]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = int8_group_linear(x, self.weight, self.scale, self.offset, self.super_scale, self.matmul_path)
        return y if bias is None else y + bias


class Int8GroupColumnParallelLinear(Int8GroupLinear, ColumnParallelLinear):
    """Int8GroupLinear's matmul in a ColumnParallelLinear."""


class Int8GroupRowParallelLinear(Int8GroupLinear, RowParallelLinear):
    """Int8GroupLinear's matmul in a RowParallelLinear (whose forward adds the ranks' parts)."""


INT8_GROUP_VERSIONS: dict[type[Linear], type[QuantizedLinear]] = {
    Linear: Int8GroupLinear, ColumnParallelLinear: Int8GroupColumnParallelLinear,
    RowParallelLinear: Int8GroupRowParallelLinear}
Int8GroupLinear.VERSIONS = INT8_GROUP_VERSIONS


def int8_group_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                      super_scale: torch.Tensor | None, path: MatmulPath) -> torch.Tensor:
    """x @ W.T: nanoqwen's kernel for few bf16 rows on CPU, else W dequantised block by block (module
    docstring)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (x.device.type == "cpu" and x.dtype == torch.bfloat16 and rows <= GEMV_MAX_ROWS
            and cpu_kernels.available()):
        return cpu_kernels.int8_group_gemv(x, q, scale, offset, super_scale)
    return int8_group_dequantized_linear(x, q, scale, offset, super_scale,
                                         torch.float32 if path.upcast_16bit(x) else None)


def int8_group_dequantized_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                                  super_scale: torch.Tensor | None = None, compute: torch.dtype | None = None
                                  ) -> torch.Tensor:
    """x @ W.T with W dequantised in row blocks (block_rows) to the compute dtype (x's by default; float32 where
    this CPU's bf16 matmuls are slow), as int4.py's int4_dequantized_linear does."""
    out_features, in_features = q.shape[0], q.shape[1] * 4 // 3 if q.dtype == torch.uint8 else q.shape[1]
    xc = x.to(compute or x.dtype)

    def product(start: int, end: int) -> torch.Tensor:
        rows = slice(start, end)
        w = dequantize_int8_group(q[rows], scale[rows], None if offset is None else offset[rows],
                                  None if super_scale is None else super_scale[rows])
        return F.linear(xc, w.to(xc.dtype))

    return linear_in_row_blocks(x, out_features, block_rows(xc, in_features), product)
