"""The token embedding, whole or cut over the vocabulary for tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.distributed import all_reduce


class VocabParallelEmbedding(nn.Module):
    """The embedding table; with tp_size > 1 only rows [vocab_start, vocab_end) of it, on this
    rank."""

    tp_dims = {"weight": 0}

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        rows = vocab_size // tp_size
        self.tp_size = tp_size
        self.vocab_start, self.vocab_end = tp_rank * rows, (tp_rank + 1) * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Each rank looks up the ids in its range and gives zeros for the others: the sum is every
        # id's row.
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        x = F.embedding(torch.where(mine, input_ids - self.vocab_start, 0), self.weight)
        return all_reduce(x.masked_fill_(~mine[:, None], 0))
