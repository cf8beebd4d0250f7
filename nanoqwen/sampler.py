"""Turn the last-position logits of a batch into one token per sequence, each with its own params.

Rows are filtered in transformers' order (temperature, top_k, top_p, min_p) and sampled with
the exponential-race trick (argmax of p / Exp(1) noise is a sample from p), which lets a
seeded request draw its noise from its own generator: the same seed gives the same tokens
whether the request runs alone or in a batch.
"""

from __future__ import annotations

import torch

from nanoqwen.sampling_params import SamplingParams


def filter_probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities over each row's kept candidates: (probs [B, K], token ids [B, K]).

    K is the vocabulary when no row uses top_k/top_p, else the largest top_k (or the vocabulary)
    so the sort touches only as many candidates as some row can keep.
    """
    b, vocab = logits.shape
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temperature[:, None]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    if min(top_k) < vocab or (top_p < 1).any():
        logits, token_ids = logits.topk(min(max(top_k), vocab), dim=-1)  # sorted, largest first
        rank = torch.arange(logits.shape[1], device=device)[None, :]
        logits = logits.masked_fill(rank >= torch.tensor(top_k, device=device)[:, None], float("-inf"))
        probs = logits.softmax(dim=-1)
        # drop a token once the tokens ranked above it already reach top_p (the first always stays)
        probs = probs.masked_fill(probs.cumsum(-1) - probs > top_p[:, None], 0.0)
    else:
        token_ids = torch.arange(vocab, device=device).expand(b, vocab)
        probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True), token_ids


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B]; greedy rows take the argmax."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    probs, token_ids = filter_probs(logits[rows], [params[i] for i in rows])
    # Noise is drawn for the whole vocabulary in token order, so a row's draw does not depend on
    # how many candidates the other rows of the batch made us keep.
    noise = torch.empty(len(rows), logits.shape[1], device=logits.device)
    for j, i in enumerate(rows):
        noise[j].exponential_(generator=generators[i])
    choice = (probs / noise.gather(1, token_ids)).argmax(dim=-1, keepdim=True)
    tokens[rows] = token_ids.gather(1, choice).squeeze(1)
    return tokens
