"""Poolers: how an embedding or reranker model reads the final hidden state at an input's last token,
instead of the LM head and the sampler (nanoqwen/config/pooling.py says which task a checkpoint is for).

EmbeddingPooler: the hidden state in float32; `finish` keeps a request's first d values and
L2-normalises them. ScorePooler: p("yes") against p("no") from just those two rows of the LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.errors import ConfigError, InvalidRequestError
from nanoqwen.pooling_params import PoolingParams
from nanoqwen.tokenizer import Tokenizer


def make_pooler(task: str, model: nn.Module, tokenizer: Tokenizer
                ) -> EmbeddingPooler | ScorePooler | None:
    """The pooler of an embedding or reranker model (None for a generative one)."""
    if task == "embed":
        return EmbeddingPooler()
    if task == "score":
        return ScorePooler.for_tokenizer(model, tokenizer)
    return None


class EmbeddingPooler:
    """hidden [M, H] at each input's last token -> float32 [M, H]; `finish` applies a request's
    dimensions and normalisation."""

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float()

    @staticmethod
    def finish(vector: torch.Tensor, params: PoolingParams) -> list[float]:
        if params.dimensions is not None:
            if params.dimensions > vector.shape[-1]:
                raise InvalidRequestError(f"dimensions={params.dimensions} is more than the "
                                          f"model's {vector.shape[-1]}")
            vector = vector[: params.dimensions]  # [d]
        if params.normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        return vector.tolist()


class ScorePooler:
    """hidden [M, H] at each input's last token -> float32 [M] relevance in [0, 1]: p("yes") against
    p("no") from the two LM-head rows. Building it keeps only those two rows of an untied head."""

    def __init__(self, model: nn.Module, yes_id: int, no_id: int) -> None:
        if model.lm_head is None:
            raise ConfigError("a reranker needs its LM head: this checkpoint was loaded without one")
        self.rows = model.lm_head.weight[[no_id, yes_id]].clone()  # [2, H]
        if not model.is_tied:
            model.lm_head = None  # the rest of the vocabulary is never read

    @classmethod
    def for_tokenizer(cls, model: nn.Module, tokenizer: Tokenizer) -> ScorePooler:
        ids = {word: tokenizer.token_to_id(word) for word in ("yes", "no")}
        if None in ids.values():
            missing = next(w for w, i in ids.items() if i is None)
            raise ConfigError(f"the tokenizer has no token {missing!r}: a Qwen3-Reranker scores "
                              "with the 'yes' and 'no' tokens")
        return cls(model, ids["yes"], ids["no"])

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.rows).float()  # [M, 2]: no, yes (model dtype, as the card)
        return torch.log_softmax(logits, dim=-1)[:, 1].exp()  # [M]

    @staticmethod
    def finish(score: torch.Tensor, params: PoolingParams) -> float:
        return float(score)


Pooler = EmbeddingPooler | ScorePooler
