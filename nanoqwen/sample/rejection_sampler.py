"""Verify draft tokens against the target model (speculative decoding) without changing what is
generated.

A sequence with m draft tokens d_1..d_m runs m + 1 rows in the step: the newest token and the
drafts. Row j's logits are the target's distribution for the token after d_j (row 0: after the
newest token), so one forward scores every draft. Each row's logits go through the same
adjustments as sampler.sample would apply at that point of the answer (min_tokens, penalties over
the answer so far including the drafts before it; then temperature, top_k, top_p, min_p), giving
p_j. Then, from the first draft on:

- greedy: d_{j+1} is accepted when it is the argmax of p_j, else the argmax is taken and the rest
  dropped;
- sampled: d_{j+1} is accepted with probability min(1, p_j(d) / q_j(d)), where q_j is the
  distribution the draft was drawn from (one-hot for a deterministic proposer such as n-gram);
  on rejection a token is drawn from max(0, p_j - q_j), normalised, and the rest dropped.

If every draft is accepted, one more token comes from the last row, as a plain step would sample
it. This is the standard rule (Leviathan et al. 2023, Chen et al. 2023): each token it emits has
exactly the distribution p_j, so the answer follows the same distribution as without speculation
(greedy: the same tokens), and a step emits between 1 and m + 1 tokens. Logprobs are the target's,
from its raw logits, as sampler.compute_logprobs gives them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from nanoqwen.sample.penalties import adjust_logits
from nanoqwen.sample.sampler import BROKEN_ROW, TokenLogprobs, compute_logprobs, dense_probs, greedy_tokens
from nanoqwen.sampling_params import SamplingParams


class VerifiedTokens(NamedTuple):
    """One sequence's tokens from a verification step: the accepted drafts, then the target's
    token."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per token (None where the request asked for none)


def rejection_sample(logits: torch.Tensor, drafts: list[list[int]],
                     draft_probs: list[torch.Tensor | None], params: list[SamplingParams],
                     generators: list[torch.Generator | None],
                     prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                     stop_token_ids: list[set[int]]) -> list[VerifiedTokens]:
    """logits [R, V] float32: sequence i's len(drafts[i]) + 1 rows, one sequence after another.
    draft_probs[i]: [len(drafts[i]), V], the distributions the drafts were drawn from (None: each
    draft was certain). The other lists are per sequence, as sampler.sample takes them."""
    # every row as a row of sampler.sample: the answer so far is the output plus the drafts before
    rows = [(i, j) for i, draft in enumerate(drafts) for j in range(len(draft) + 1)]
    row_params = [params[i] for i, _ in rows]
    adjusted = adjust_logits(logits, row_params, [prompt_token_ids[i] for i, _ in rows],
                             [output_token_ids[i] + drafts[i][:j] for i, j in rows],
                             [stop_token_ids[i] for i, _ in rows])
    greedy = greedy_tokens(adjusted).tolist()  # [R] (BROKEN_ROW where the logits leave nothing to pick)
    sampled_rows = [r for r, p in enumerate(row_params) if not p.greedy]
    probs = {}  # row -> p [V], for the rows of sampled (not greedy) requests
    if sampled_rows:
        dense = dense_probs(adjusted[sampled_rows], [row_params[r] for r in sampled_rows])
        probs = dict(zip(sampled_rows, dense, strict=True))
    out: list[list[int]] = []
    starts = _starts(drafts)
    for i, draft in enumerate(drafts):
        g, q = generators[i], draft_probs[i]
        tokens = []
        for j in range(len(draft) + 1):
            r = starts[i] + j
            if params[i].greedy:
                tokens.append(greedy[r])
                if j == len(draft) or greedy[r] != draft[j]:
                    break
                continue
            p = probs[r]
            if j == len(draft):  # every draft accepted: one more token, as a plain step samples
                tokens.append(_draw(p, g))
                break
            d = draft[j]
            q_d = 1.0 if q is None else float(q[j, d])
            u = float(torch.rand((), generator=g, device=p.device))
            if u * q_d < float(p[d]):  # accepted with probability min(1, p(d) / q(d))
                tokens.append(d)
                continue
            if q is None:  # q one-hot at d: the residual is p without d
                residual = p.clone()
                residual[d] = 0
            else:
                residual = (p - q[j]).clamp_(min=0)
            tokens.append(_draw(residual if float(residual.sum()) > 0 else p, g))
            break
        out.append(tokens)
    # the target's logprobs of the emitted tokens, each from its own row
    emitted_rows = [s + j for s, tokens in zip(starts, out, strict=True)
                    for j in range(len(tokens))]
    flat = [t for tokens in out for t in tokens]
    emitted = torch.tensor([max(t, 0) for t in flat], device=logits.device)  # (a BROKEN_ROW has none)
    index = torch.tensor(emitted_rows, device=logits.device)
    logprobs = iter([None if t == BROKEN_ROW else lp for t, lp in zip(flat, compute_logprobs(
        logits.index_select(0, index), [row_params[r] for r in emitted_rows], emitted), strict=True)])
    return [VerifiedTokens(tokens, [next(logprobs) for _ in tokens]) for tokens in out]


def _starts(drafts: list[list[int]]) -> list[int]:
    """Each sequence's first row."""
    starts, row = [], 0
    for draft in drafts:
        starts.append(row)
        row += len(draft) + 1
    return starts


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn from probs [V] (not necessarily normalised); BROKEN_ROW when they are no distribution
    (NaN, inf, or all 0)."""
    total = float(probs.sum())
    if not (math.isfinite(total) and total > 0):
        return BROKEN_ROW
    return int(torch.multinomial(probs, 1, generator=generator))
