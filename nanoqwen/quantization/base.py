"""What the int8 and int4 formats share: `QuantizedLinear` (a Linear whose matrix is stored quantised),
the row-block sizes of quantising and dequantising, and `block_rows`. The formats: int8.py, int4.py; the
model-level functions: __init__.py."""

from __future__ import annotations

import torch
from torch import nn

from nanoqwen.models.qwen3 import Linear
from nanoqwen.ops import cpu

# the largest model-dtype copy of a weight block the dequantise path makes on a GPU (on a CPU, BF16_BLOCK_BYTES
# below, or for float32 compute ops/cpu.py's UPCAST_BLOCK_BYTES)
DEQUANT_BLOCK_BYTES = 16 << 20
QUANTIZE_BLOCK_ELEMENTS = 1 << 18  # rows quantised at a time: float32 temporaries of 1 MiB
# On a CPU whose bf16 matmuls are fast (native bf16, AMX), the int8 and int4 layers' bf16 copy of a block of weight
# rows for torch's matmul over many rows is at most this big: whole matrices of the smaller models. A matmul per
# 4 MiB block (UPCAST_BLOCK_BYTES, which the float32 path keeps small to stay in the cache) made a Qwen3-0.6B layer's
# four products at 512 rows 1.3x slower than one matmul each, in int8 and int4 alike (BENCHMARKS.md).
BF16_BLOCK_BYTES = 64 << 20


class QuantizedLinear(Linear):
    """A Linear whose matrix is stored quantised, as buffers: `weight` (int8 [out, in], or int4
    packed two to a byte [out, in/2]) and its scales (`BUFFERS`), with the bias in the model dtype.

    Only `matmul` differs from Linear: a tensor-parallel linear's quantised version (e.g.
    Int8ColumnParallelLinear, Int8RowParallelLinear in int8.py) keeps its class's forward, all_reduce
    included.
    """

    BUFFERS: tuple[str, ...] = ("weight",)
    # the quantised version of each Linear class (set by each format after its subclasses: int8.py, int4.py)
    VERSIONS: dict[type[Linear], type[QuantizedLinear]] = {}

    def __init__(self, *buffers: torch.Tensor, bias: nn.Parameter | None = None) -> None:
        """The BUFFERS in order, then the bias [out] (or None); see from_linear."""
        nn.Module.__init__(self)  # not Linear.__init__: no model-dtype weight to allocate
        for name, tensor in zip(self.BUFFERS, buffers, strict=True):
            self.register_buffer(name, tensor)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: Linear) -> QuantizedLinear:
        """The quantised version of a Linear (scales and bias in the Linear's dtype); the Linear is
        left as it is."""
        version = cls.VERSIONS[type(linear)]
        quantized = version(*version.quantize(linear.weight), bias=linear.bias)
        for name in ("output_sizes", "tp_size"):  # a tensor-parallel linear's own attributes
            if hasattr(linear, name):
                setattr(quantized, name, getattr(linear, name))
        return quantized

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def scale_rounded_up(s32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 scales stored in the model dtype, rounded up where rounding to nearest went down (one step of that
    dtype at most), so that the largest weight divided by its stored scale stays within the grid: no clipping."""
    s = s32.to(dtype)
    return torch.where(s.float() < s32, torch.nextafter(s, torch.tensor(float("inf"), dtype=dtype, device=s.device)), s)


def block_rows(xc: torch.Tensor, in_features: int) -> int:
    """How many weight rows the dequantise paths convert at a time, for activations xc in the compute dtype."""
    if xc.device.type != "cpu":
        block_bytes = DEQUANT_BLOCK_BYTES
    else:  # float32 compute (a CPU without fast bf16, or a float32 model): cache-sized blocks
        block_bytes = cpu.UPCAST_BLOCK_BYTES if xc.dtype == torch.float32 else BF16_BLOCK_BYTES
    return max(1, block_bytes // (max(in_features, 1) * xc.element_size()))
