"""The quantised checkpoints of the Hugging Face hub as plain tensor functions: AWQ and GPTQ 4-bit matrices unpacked
into integers with a scale and an offset per group of inputs (ops/gguf_quants.py's GroupedWeights: what nanoqwen's
int4 format holds without loss), and FP8 block-quantised ones dequantised (the reference of quantization/fp8.py).

AWQ (`quant_method: awq`, `version: gemm`, as AutoAWQ writes it), for a Linear with K inputs and N outputs, groups
of G inputs:
    qweight [K, N/8] int32: eight 4-bit values of a row of W.T, output columns in AWQ's interleaved order: nibble
            i (bits 4i .. 4i + 3) holds column 8c + AWQ_ORDER[i]
    qzeros  [K/G, N/8] int32, the same packing;   scales [K/G, N] float16
    W[n, k] = (q[k, n] - zero[k / G, n]) * scale[k / G, n]

GPTQ (`quant_method: gptq`, 4 bits, as AutoGPTQ and GPTQModel write it):
    qweight [K/8, N] int32: eight consecutive inputs of a column, input 8r + i in nibble i
    qzeros  [groups, N/8] int32, output n in nibble n % 8 (in `checkpoint_format: gptq`, AutoGPTQ's, the stored
            value is the zero minus 1; `gptq_v2` stores the zero)
    scales  [groups, N] float16;   g_idx [K] int32: each input's group (act order, `desc_act: true`, sorts the inputs
            by importance before grouping: then a group's inputs are not consecutive)
    W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]
With act order the inputs are permuted so that each group's are consecutive (`input_order`): the layer multiplies
x[..., input_order] by the permuted matrix, the same product.

Both are exact as q * scale + offset with offset = -zero * scale in float32 (a float16 times an integer below 16).

FP8 (`quant_method: fp8`, `fmt: e4m3`, as Qwen's Qwen3-*-FP8 are published): weight [N, K] float8_e4m3fn and
weight_scale_inv [N/bn, K/bk] float32 for blocks of bn x bk (`weight_block_size`, [128, 128]):
    W[n, k] = weight[n, k] * weight_scale_inv[n / bn, k / bk]
"""

from __future__ import annotations

import torch

from nanoqwen.errors import WeightsError
from nanoqwen.ops.gguf_quants import GroupedWeights

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 holds output column AWQ_ORDER[i] of its eight


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., c] -> uint8 [..., c, 8]: nibble i (bits 4i .. 4i + 3) at i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed[..., None] >> shifts) & 15).to(torch.uint8)


def _grouped(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int) -> GroupedWeights:
    """q uint8 [N, K], zero and scale [N, K/G] -> q * scale + offset with offset = -zero * scale (exact in float32)."""
    scale32 = scale.float()
    return GroupedWeights(q.contiguous(), scale32.contiguous(), (-zero.float() * scale32).contiguous(), group)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> GroupedWeights:
    """An AWQ (GEMM) Linear's tensors -> its matrix [N, K] as GroupedWeights (module docstring)."""
    k, n = qweight.shape[0], scales.shape[1]
    order = torch.tensor(AWQ_ORDER).argsort()  # column j of eight is nibble order[j]

    def columns(packed: torch.Tensor) -> torch.Tensor:  # [rows, N/8] int32 -> [rows, N] uint8, columns in order
        return _nibbles(packed)[..., order].reshape(packed.shape[0], -1)

    q, zero = columns(qweight), columns(qzeros)  # [K, N], [K/G, N]
    if q.shape != (k, n) or zero.shape != scales.shape or k % group:
        raise WeightsError(f"AWQ tensors do not fit together: qweight {list(qweight.shape)}, qzeros "
                           f"{list(qzeros.shape)}, scales {list(scales.shape)} with group_size {group}")
    return _grouped(q.T, zero.T, scales.T, group)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                group: int, zeros_minus_one: bool) -> tuple[GroupedWeights, torch.Tensor | None]:
    """A GPTQ Linear's tensors -> (its matrix [N, K] as GroupedWeights with consecutive groups, the input order that
    makes them consecutive or None where they already are); see the module docstring."""
    n = qweight.shape[1]
    q = _nibbles(qweight.T).reshape(n, -1)  # [N, K]: input 8r + i from nibble i of row r
    k = q.shape[1]
    zero = _nibbles(qzeros).reshape(qzeros.shape[0], -1)[:, :n].to(torch.int16) + int(zeros_minus_one)  # [groups, N]
    if zero.shape != scales.shape or k % group or scales.shape[0] != k // group:
        raise WeightsError(f"GPTQ tensors do not fit together: qweight {list(qweight.shape)}, qzeros "
                           f"{list(qzeros.shape)}, scales {list(scales.shape)} with group_size {group}")
    order = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        order = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[order], torch.arange(k) // group):
            raise WeightsError(f"GPTQ g_idx puts other than {group} inputs in a group; nanoqwen reads groups of "
                               "group_size inputs (any order)")
        q = q[:, order]
    return _grouped(q, zero.T, scales.T, group), order


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """An FP8 block-quantised matrix: weight [N, K] float8 times its block's scale, in float32 (module docstring;
    scale_inv [N/bn, K/bk], or one row per weight row: [N, K/bk])."""
    n, k = weight.shape
    rows, cols = -(-n // scale_inv.shape[0]), -(-k // scale_inv.shape[1])  # the block's shape
    scale = scale_inv.float().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    return weight.float() * scale
