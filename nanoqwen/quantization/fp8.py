"""FP8 weights as Qwen publishes them (`Qwen/Qwen3-*-FP8`: `quant_method: fp8`, e4m3, blocks of 128 x 128 with a
float32 scale each): `Fp8Linear` keeps each weight at one byte (float8_e4m3fn) with its block scales, one row of
them per weight row (`scale` [out, in / 128]: 4 bytes per 128 weights more than the file's per-block ones, so that
fused q/k/v and gate/up rows simply stack), and computes with exactly weight * scale (ops/hf_quants.py
dequantize_fp8 is the reference). Few bf16 rows on a CPU (decode) run nanoqwen's `fp8_gemv` (ops/cpu/kernels.py:
each e4m3 byte widened to float32 as it is read, products summed in float32 per block, each block's sum scaled
once), in the fused CPU decode step too; more rows (prompts), other dtypes and devices dequantise row block by row
block to the compute dtype and multiply there (a GPU's FP8 matmul, torch._scaled_mm, is not used yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoqwen.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu.matmul import linear_in_row_blocks
from nanoqwen.ops.hf_quants import dequantize_fp8
from nanoqwen.quantization.base import QuantizedLinear, block_rows

GEMV_MAX_ROWS = 16  # rows of x nanoqwen's FP8 kernel takes (decode); more dequantise (a prompt)


class Fp8Linear(QuantizedLinear):
    """y = x @ (weight * scale).T + bias: `weight` float8_e4m3fn [out, in], `scale` float32 [out, in / block]."""

    BUFFERS = ("weight", "scale")

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if (x.device.type == "cpu" and x.dtype == torch.bfloat16 and rows <= GEMV_MAX_ROWS
                and cpu_kernels.available()):
            y = cpu_kernels.fp8_gemv(x, self.weight, self.scale)
            return y if bias is None else y + bias
        compute = torch.float32 if self.matmul_path.upcast_16bit(x) else x.dtype
        xc = x.to(compute)

        def product(start: int, end: int) -> torch.Tensor:
            return F.linear(xc, dequantize_fp8(self.weight[start:end], self.scale[start:end]).to(compute))

        y = linear_in_row_blocks(x, self.out_features, block_rows(xc, self.in_features), product)
        return y if bias is None else y + bias


class Fp8ColumnParallelLinear(Fp8Linear, ColumnParallelLinear):
    """Fp8Linear's matmul in a ColumnParallelLinear."""


class Fp8RowParallelLinear(Fp8Linear, RowParallelLinear):
    """Fp8Linear's matmul in a RowParallelLinear."""


FP8_VERSIONS: dict[type[Linear], type[QuantizedLinear]] = {
    Linear: Fp8Linear, ColumnParallelLinear: Fp8ColumnParallelLinear, RowParallelLinear: Fp8RowParallelLinear}
Fp8Linear.VERSIONS = FP8_VERSIONS
