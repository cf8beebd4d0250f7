"""The grouped int8 format (a GGUF file's Q8_0, Q5_*, Q6_K): which path a product takes, and that both compute the
format's weights."""

from __future__ import annotations

import pytest
import torch

from nanoqwen.layers.linear import Linear
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.quantize import dequantize_int8_group, pack_int5, pack_int6
from nanoqwen.quantization.int8_group import GEMV_MAX_ROWS, Int8GroupLinear


@pytest.mark.parametrize("bits", [8, 6, 5], ids=["int8", "int6", "int5"])
def test_few_rows_take_the_kernel_and_more_the_dequantised_product(bits):
    """Up to GEMV_MAX_ROWS rows of bf16 x run int8_group_gemv (x quantised per group: its exact bits), more the
    dequantised product; whether the values are int8 or packed at 6 bits (Q6_K's, with two-level scales) or 5 bits
    (Q5_K's, with two-level scales and offsets), whose rows are 3/4 and 5/8 as wide."""
    if not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels are not available here")
    g = torch.Generator().manual_seed(1)
    if bits == 5:
        q = torch.randint(0, 32, (40, 512), generator=g, dtype=torch.int8)
        sub = torch.randint(0, 64, (40, 16), generator=g, dtype=torch.uint8)
        off, super_scale, super_offset = torch.randint(0, 64, (40, 16), generator=g, dtype=torch.uint8), \
            torch.rand(40, 2) * 1e-3, -torch.rand(40, 2) * 1e-3
    else:
        q = torch.randint(-32, 32, (40, 512), generator=g, dtype=torch.int8)
        sub, super_scale = torch.randint(-128, 128, (40, 32), generator=g, dtype=torch.int8), torch.rand(40, 2) * 1e-3
        off = super_offset = None
    with torch.device("meta"):
        template = Linear(512, 40)
    packed = {8: q, 6: pack_int6(q), 5: pack_int5(q)}[bits]
    layer = Int8GroupLinear.from_buffers(template, packed, sub, off, super_scale, super_offset)
    assert layer.in_features == 512 and layer.weight.shape[1] == 512 * bits // 8
    x = torch.randn(GEMV_MAX_ROWS + 1, 512, generator=g).to(torch.bfloat16)
    few = x[:GEMV_MAX_ROWS]
    assert torch.equal(layer(few), cpu_kernels.int8_group_gemv(few, q, sub, off, super_scale, super_offset))
    w = dequantize_int8_group(q, sub, off, super_scale, super_offset)
    assert torch.equal(w, dequantize_int8_group(packed, sub, off, super_scale, super_offset))
    want = x.float() @ w.T
    assert (layer(x).float() - want).abs().max() <= 2e-2 * want.abs().max()  # (bf16 weights and output)
    assert not torch.equal(layer(x)[:GEMV_MAX_ROWS], layer(few))  # (the other path: x not quantised)
