"""Qwen3-MoE's experts, computed grouped by expert: the fast path beside `experts_reference`
(nanoqwen/models/qwen3.py), which defines them token by token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.config.model import Qwen3Config
from nanoqwen.ops.cpu.matmul import TORCH_MATMUL, MatmulPath


class Experts(nn.Module):
    """E SwiGLU MLPs, stacked: gate_up_proj [E, 2Ie, H] (each expert's gate rows, then its up rows),
    down_proj [E, H, Ie]. Tensor parallelism splits every expert over Ie, like the dense MLP over I:
    a rank holds Ie/tp of each expert's columns ([gate_r; up_r] rows, the matching down_proj
    columns)."""

    tp_dims = {"gate_up_proj": 1, "down_proj": 2}
    # A checkpoint tensor that fills all of gate_up_proj (transformers 5's fused experts) holds the
    # gate rows, then the up rows, along the cut dimension: the loader cuts each of the 2 parts on
    # its own.
    tp_fused_parts = {"gate_up_proj": 2}

    def __init__(self, config: Qwen3Config, tp_size: int = 1, matmul: MatmulPath = TORCH_MATMUL) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size // tp_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.matmul_path = matmul

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """experts_reference, grouped by expert: x [N, H]; expert_ids, weights [N, K] -> [N, H].

        The N*K (token, expert) assignments are sorted by expert, so each expert that got tokens
        runs one matmul pair over all of its tokens; results are weighted and added back to their
        tokens.
        """
        k = expert_ids.shape[1]
        order = expert_ids.flatten().argsort(stable=True)  # [N*K] assignments, grouped by expert
        tokens = order // k  # [N*K] the token of each sorted assignment
        xs, ws = x[tokens], weights.flatten()[order, None]  # [N*K, H], [N*K, 1]
        counts = torch.bincount(expert_ids.flatten(), minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            start += count
            # [count, Ie] each
            gate, up = self.expert_linear(xs[rows], "gate_up_proj", e).chunk(2, dim=-1)
            y = self.expert_linear(F.silu(gate) * up, "down_proj", e)  # [count, H]
            out.index_add_(0, tokens[rows], y * ws[rows])
        return out

    @property
    def num_experts(self) -> int:
        return len(self.gate_up_proj)

    def expert_linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        """x [n, in] through expert e's matrix `name` (gate_up_proj or down_proj) -> [n, out]. The
        one place that reads the matrices: int8 and int4 experts (nanoqwen/quantization/) override it."""
        return self.matmul_path.linear(x, getattr(self, name)[e])
