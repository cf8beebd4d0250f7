"""Linear layers, whole or cut for tensor parallelism (nanoqwen/distributed.py), as the models use them.

`Linear.matmul` is the one place that reads a weight: it multiplies through the engine's `MatmulPath`
(nanoqwen/ops/cpu/matmul.py: torch's F.linear, or on CPUs nanoqwen's own kernels where they were chosen), and
the weight-only int8 and int4 versions (nanoqwen/quantization/) override it.

`ColumnParallelLinear` holds 1/tp of the output rows (qkv_proj: Hq/tp query and Hkv/tp key-value heads;
gate_up_proj: I/tp MLP columns; the LM head: V/tp vocabulary rows), `RowParallelLinear` the matching 1/tp of
the input columns (o_proj, down_proj), so its output is this rank's part of a sum, which one all_reduce adds
up. Each class's `tp_dims` says which dimension of which parameter is cut: the loader reads only that slice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nanoqwen.distributed import all_reduce
from nanoqwen.ops.cpu.matmul import TORCH_MATMUL, MatmulPath


class Linear(nn.Module):
    """y = x @ weight.T + bias; weight [out, in], filled by the loader. Whole on every rank (tp_dims
    empty)."""

    # parameter -> the dimension tensor parallelism cuts (the loader reads it)
    tp_dims: dict[str, int] = {}

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 matmul: MatmulPath = TORCH_MATMUL) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.matmul_path = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul_path.linear(x, self.weight, bias)


class ColumnParallelLinear(Linear):
    """A Linear whose output rows are cut over the ranks: each holds 1/tp of every part of
    `output_sizes` (qkv_proj: [q; k; v], gate_up_proj: [gate; up]), stacked [part_0 of this rank;
    part_1 of this rank; ...]. Nothing to add up: each rank's outputs are its own heads or
    columns."""

    tp_dims = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp_size: int = 1, matmul: MatmulPath = TORCH_MATMUL) -> None:
        self.output_sizes = [size // tp_size for size in output_sizes]  # this rank's part of each
        super().__init__(in_features, sum(self.output_sizes), bias, matmul)


class RowParallelLinear(Linear):
    """A Linear whose input columns are cut over the ranks (the ones a ColumnParallelLinear before
    it left on this rank): its output is this rank's part of a sum, and all_reduce adds the parts.
    The bias must be added once, so only rank 0 has one (as in vLLM)."""

    tp_dims = {"weight": 1}
    # parameters the other ranks do not have (the loader skips them there)
    tp_rank0_only = ("bias",)
    # Called as a forward hook is, hook(module, (x,), y) -> a new y or None (y unchanged), on this rank's part
    # of the sum before the all_reduce: LoRA's adapters (nanoqwen/lora/layers.py) add their own part there
    # (x_shard @ A_shard^T @ B^T), so that the one all_reduce sums both.
    partial_sum_hook: Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor | None] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, matmul: MatmulPath = TORCH_MATMUL) -> None:
        super().__init__(in_features // tp_size, out_features, bias and tp_rank == 0, matmul)
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)  # [N, out]: this rank's part of the sum
        if self.partial_sum_hook is not None and (hooked := self.partial_sum_hook(self, (x,), y)) is not None:
            y = hooked
        return all_reduce(y) if self.tp_size > 1 else y
