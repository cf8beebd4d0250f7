"""What the int8 and int4 layers share: `QuantizedLinear` (a Linear whose matrix is stored quantised),
the row-block sizes of dequantising, and `block_rows`. The layers: int8.py, int4.py; the formats' tensor
functions: nanoqwen/ops/quantize.py; the model-level functions: __init__.py."""

from __future__ import annotations

import torch
from torch import nn

from nanoqwen.layers.linear import Linear
from nanoqwen.ops.cpu.matmul import UPCAST_BLOCK_BYTES

# the largest model-dtype copy of a weight block the dequantise path makes on a GPU (on a CPU, BF16_BLOCK_BYTES
# below, or for float32 compute nanoqwen/ops/cpu/matmul.py's UPCAST_BLOCK_BYTES)
DEQUANT_BLOCK_BYTES = 16 << 20
# On a CPU whose bf16 matmuls are fast (native bf16, AMX), the int8 and int4 layers' bf16 copy of a block of weight
# rows for torch's matmul over many rows is at most this big: whole matrices of the smaller models, one matmul
# each (a matmul per 4 MiB block, the UPCAST_BLOCK_BYTES the float32 path keeps small to stay in the cache, was
# slower for prompts: bench/bench_model.py measures int8 and int4 prefill).
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
        return cls.from_buffers(linear, *cls.VERSIONS[type(linear)].quantize(linear.weight))

    @classmethod
    def from_buffers(cls, linear: Linear, *buffers: torch.Tensor | None) -> QuantizedLinear:
        """The quantised version of a Linear with these BUFFERS (already in this format: a checkpoint's own
        quantised matrix), the Linear's bias and its other attributes; the Linear is left as it is."""
        quantized = cls.VERSIONS[type(linear)](*buffers, bias=linear.bias)
        quantized.matmul_path = linear.matmul_path
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


def block_rows(xc: torch.Tensor, in_features: int) -> int:
    """How many weight rows the dequantise paths convert at a time, for activations xc in the compute dtype."""
    if xc.device.type != "cpu":
        block_bytes = DEQUANT_BLOCK_BYTES
    else:  # float32 compute (a CPU without fast bf16, or a float32 model): cache-sized blocks
        block_bytes = UPCAST_BLOCK_BYTES if xc.dtype == torch.float32 else BF16_BLOCK_BYTES
    return max(1, block_bytes // (max(in_features, 1) * xc.element_size()))
