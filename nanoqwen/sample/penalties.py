"""Steps b and c of the sampler (nanoqwen/sample/sampler.py), what changes a row's logits before it
is sampled: min_tokens' stop tokens blocked, then the repetition, presence and frequency penalties, then
DRY (nanoqwen/sample/dry.py, after the other penalties as in llama.cpp's sampler chain).
Each returns `logits` itself when no row of the batch needs it, else a changed copy.
"""

from __future__ import annotations

import torch

from nanoqwen.sample.dry import apply_dry
from nanoqwen.sampling_params import SamplingParams


def token_counts(token_ids: list[list[int]], vocab: int, device: torch.device | str,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """How often each token occurs in each row's list: [R, V], built with one scatter_add for
    all rows."""
    width = max((len(t) for t in token_ids), default=0)
    # pad with `vocab`, an extra column dropped at the end (ids out of range land there too)
    padded_rows = [[*t, *[vocab] * (width - len(t))] for t in token_ids]
    padded = torch.tensor(padded_rows, dtype=torch.long)
    padded = padded.masked_fill((padded < 0) | (padded > vocab), vocab)
    padded = padded.view(len(token_ids), width).to(device)  # [R, W]
    counts = torch.zeros(len(token_ids), vocab + 1, device=device, dtype=dtype)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device, dtype=dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]]) -> torch.Tensor:
    """logits [B, V] -> a penalised copy (or `logits` itself when no row has a penalty); see
    step c. Only the tokens a row has seen change: they are found as (row, token) keys with their
    output counts, so the work grows with the tokens seen, not with rows times the vocabulary
    (apply_penalties_reference counts densely)."""
    rows = [i for i, p in enumerate(params)
            if p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    out = logits.clone()
    flat = out.view(-1)  # [B * V]: entry row * V + token

    def keys(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct (row, token) pairs of lists (one a penalised row) as flat indices into
        `flat`, with how often each occurs."""
        ids = torch.tensor([t for i in rows for t in lists[i]], dtype=torch.long)
        row = torch.repeat_interleave(torch.tensor(rows), torch.tensor([len(lists[i]) for i in rows]))
        inside = (ids >= 0) & (ids < vocab)
        found, count = torch.unique(row[inside] * vocab + ids[inside], return_counts=True)
        return found.to(device), count.to(device, logits.dtype)

    outputs, output_counts = keys(output_token_ids)
    if any(params[i].repetition_penalty != 1 for i in rows):
        prompts = [prompt_token_ids[i] if params[i].repetition_penalty != 1 else [] for i in range(len(params))]
        seen = torch.unique(torch.cat([keys(prompts)[0], outputs]))  # prompt or output, once
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device,
                               dtype=logits.dtype)[seen // vocab]
        value = flat[seen]
        flat[seen] = torch.where(value > 0, value / penalty, value * penalty)
    presence = torch.tensor([p.presence_penalty for p in params], device=device, dtype=logits.dtype)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=logits.dtype)
    row = outputs // vocab
    flat[outputs] = flat[outputs] - presence[row] - frequency[row] * output_counts  # (the reference's order)
    return out


def apply_penalties_reference(logits: torch.Tensor, params: list[SamplingParams],
                    prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]]) -> torch.Tensor:
    """apply_penalties by dense counts: [R, V] tensors of each row's prompt and output counts, the
    penalties applied over the whole vocabulary (the definition apply_penalties is tested against)."""
    rows = [i for i, p in enumerate(params)
            if p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    rows_t = torch.tensor(rows, device=device)
    sub = logits[rows_t]  # [R, V]
    outputs = [output_token_ids[i] for i in rows]
    output_counts = token_counts(outputs, vocab, device, logits.dtype)  # [R, V]
    rep = [params[i].repetition_penalty for i in rows]
    if any(r != 1 for r in rep):
        # only rows with a repetition penalty need their prompt counted
        prompts = [prompt_token_ids[i] if params[i].repetition_penalty != 1 else [] for i in rows]
        prompt_counts = token_counts(prompts, vocab, device, logits.dtype)
        seen = (prompt_counts > 0) | (output_counts > 0)  # [R, V]
        penalty = torch.tensor(rep, device=device, dtype=logits.dtype)[:, None]  # [R, 1]
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    presence = torch.tensor([params[i].presence_penalty for i in rows], device=device,
                            dtype=logits.dtype)
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=device,
                             dtype=logits.dtype)
    sub = sub - presence[:, None] * (output_counts > 0) - frequency[:, None] * output_counts
    return logits.index_copy(0, rows_t, sub)


def block_stop_tokens(logits: torch.Tensor, params: list[SamplingParams],
                      output_token_ids: list[list[int]],
                      stop_token_ids: list[set[int]]) -> torch.Tensor:
    """logits [B, V] -> a copy with each row's stop ids at -inf while it is short of min_tokens,
    except in a row that this would leave with no token to sample; see step b."""
    vocab = logits.shape[1]
    index = [(i, t) for i, p in enumerate(params) if len(output_token_ids[i]) < p.min_tokens
             for t in stop_token_ids[i] if 0 <= t < vocab]
    if not index:
        return logits
    rows, cols = torch.tensor(index, device=logits.device).unbind(1)
    minus_inf = torch.tensor(float("-inf"), device=logits.device, dtype=logits.dtype)
    blocked = logits.index_put((rows, cols), minus_inf)
    touched = rows.unique()
    left_empty = touched[torch.isneginf(blocked[touched]).all(dim=-1)]  # only stops were allowed
    blocked[left_empty] = logits[left_empty]
    return blocked


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams],
                  prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                  stop_token_ids: list[set[int]]) -> torch.Tensor:
    """Steps b and c: stop tokens blocked while short of min_tokens, then the penalties, then DRY (dry.py; a
    copy, or `logits` itself when no row needs any)."""
    logits = block_stop_tokens(logits, params, output_token_ids, stop_token_ids)
    logits = apply_penalties(logits, params, prompt_token_ids, output_token_ids)
    return apply_dry(logits, params, prompt_token_ids, output_token_ids)
