"""The token embedding, whole or cut over the vocabulary for tensor parallelism."""

from __future__ import annotations

from collections.abc import Callable

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
        return vocab_parallel_lookup(input_ids, self.vocab_start, self.vocab_end,
                                     lambda ids: F.embedding(ids, self.weight))


def vocab_parallel_lookup(input_ids: torch.Tensor, vocab_start: int, vocab_end: int,
                          lookup: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Every id's row [N, H] from ranks that each hold rows [vocab_start, vocab_end) of the table (lookup(ids):
    rows of this rank's part): each rank looks up the ids in its range and gives zeros for the others, so the
    sum over the ranks (one all_reduce) is every id's row."""
    mine = (input_ids >= vocab_start) & (input_ids < vocab_end)
    x = lookup(torch.where(mine, input_ids - vocab_start, 0))
    return all_reduce(x.masked_fill_(~mine[:, None], 0))
