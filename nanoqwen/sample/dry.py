"""DRY ("don't repeat yourself"): a penalty on the tokens that would continue a verbatim repeat of earlier context.

The scheme is p-e-w's (text-generation-webui); the semantics here are llama.cpp's `llama_sampler_dry` (ported from
koboldcpp), field for field:

- the context is the last `dry_penalty_last_n` tokens of prompt + output (-1: all of them; 0 or
  dry_multiplier 0: DRY off); with no more than `dry_allowed_length` of them nothing happens;
- sequence breakers: no repeat reaches back across one. The nearest restart sequence from the end caps the repeat
  length at the tokens after it (if that cap is below dry_allowed_length, nothing is penalised);
- for every earlier position j, L(j) = the length of the longest run ending at j that equals the run ending at the
  end of the context (capped as above). A token t that follows such a run (t = context[j + 1]) with
  L(j) >= dry_allowed_length would extend a repeat of length L(j): its logit loses
  dry_multiplier * dry_base ** (L - dry_allowed_length), L the largest such run t follows. The exponent is clamped
  so that the power stays below float32's largest value (llama.cpp's clamp; a multiplier above 1 can still take
  a logit to -inf, as there);
- single-token breakers themselves are never penalised.

Breakers are strings; as llama.cpp does, each is matched against the text of every vocabulary token
(`DryBreakers.from_tokenizer`): a token whose text contains a breaker is a single-token breaker (with Qwen's
vocabulary, "\\n" is in 4,000-odd tokens such as ".\\n\\n"); a token whose text ends with the start of a breaker
is the head of a multi-token restart sequence, its tail the tokenization of the rest of the breaker (at most
MAX_TAIL_TOKENS tokens). A breaker longer than MAX_BREAKER_CHARS characters is cut to that length (llama.cpp's
limits).

Two implementations: `dry_penalties_reference`, one sequence in plain Python over token lists (the definition), and
`apply_dry`, what the sampler runs: the whole batch at once, with tensor operations over the candidate positions
(those whose token equals the context's last), tested equal to the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from nanoqwen.sampling_params import SamplingParams
from nanoqwen.tokenizer import Tokenizer

MAX_BREAKER_CHARS = 40
MAX_TAIL_TOKENS = 20
FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: the exponent's clamp


@dataclass(frozen=True, eq=False)
class DryBreakers:
    """A request's sequence breakers as token ids: each head token with the tails that complete a restart
    sequence after it (an empty tail: the head alone breaks)."""

    heads: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    single: frozenset[int] = field(init=False)  # the single-token breakers (never penalised)
    head_ids: torch.Tensor = field(init=False)  # int64 [heads], for finding them in a window at once

    def __post_init__(self) -> None:
        object.__setattr__(self, "single", frozenset(t for t, tails in self.heads.items() if () in tails))
        object.__setattr__(self, "head_ids", torch.tensor(sorted(self.heads), dtype=torch.long))

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, breakers: tuple[str, ...]) -> DryBreakers:
        """The breakers of these strings under this tokenizer (cached by tokenizer and strings)."""
        return _from_tokenizer(tokenizer, tuple(breakers))


@lru_cache(maxsize=2)
def _token_texts(tokenizer: Tokenizer) -> list[str]:
    """Every vocabulary token's text (special tokens included)."""
    return tokenizer.backend.decode_batch([[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=False)


@lru_cache(maxsize=64)
def _from_tokenizer(tokenizer: Tokenizer, breakers: tuple[str, ...]) -> DryBreakers:
    texts = _token_texts(tokenizer)
    heads: dict[int, list[tuple[int, ...]]] = {}

    def add(token: int, tail: tuple[int, ...]) -> None:
        known = heads.setdefault(token, [])
        if tail not in known:
            known.append(tail)

    for breaker in breakers:
        breaker = breaker[:MAX_BREAKER_CHARS]
        starts = tuple(breaker[:k] for k in range(1, len(breaker)))  # what a token may end with
        rests = {k: tuple(tokenizer.encode(breaker[k:])[:MAX_TAIL_TOKENS]) for k in range(1, len(breaker))}
        for token, text in enumerate(texts):
            if breaker in text:
                add(token, ())
            elif starts and text.endswith(starts):
                for k in range(len(breaker) - 1, 0, -1):
                    if text.endswith(starts[k - 1]):
                        add(token, rests[k])
    return DryBreakers({t: tuple(tails) for t, tails in heads.items()})


NO_BREAKERS = DryBreakers()


def dry_on(params: SamplingParams) -> bool:
    """Whether DRY penalises anything for these params."""
    return params.dry_multiplier > 0 and params.dry_penalty_last_n != 0


def resolve_dry_breakers(params: SamplingParams, tokenizer: Tokenizer) -> None:
    """Give params its sequence breakers as token ids (params._dry_breakers), when DRY is on: the engine calls this
    as a request arrives. Matched on each token's decoded text (a token holding part of a multi-byte character
    decodes to U+FFFD, so a breaker made of such characters matches only whole tokens)."""
    if dry_on(params):
        params._dry_breakers = DryBreakers.from_tokenizer(tokenizer, tuple(params.dry_sequence_breakers or ()))


def max_exponent(base: float) -> int:
    """The largest exponent DRY raises base to (0: no clamp, for a base this close to 1)."""
    return int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0


def dry_window(prompt_token_ids: list[int], output_token_ids: list[int], last_n: int) -> list[int]:
    """The tokens DRY looks at: the last last_n of prompt + output (-1: all)."""
    if last_n == -1:
        return prompt_token_ids + output_token_ids
    if last_n <= len(output_token_ids):
        return output_token_ids[len(output_token_ids) - last_n:]
    return prompt_token_ids[max(0, len(prompt_token_ids) + len(output_token_ids) - last_n):] + output_token_ids


def dry_penalties_reference(context: list[int], params: SamplingParams,
                            breakers: DryBreakers | None = None) -> dict[int, float]:
    """One sequence's DRY penalties, token -> what its logit loses, by the definition (see the module's
    docstring); context: its prompt + output tokens; breakers: params._dry_breakers unless given."""
    breakers = breakers or params._dry_breakers or NO_BREAKERS
    allowed = params.dry_allowed_length
    if not dry_on(params):
        return {}
    window = dry_window(context, [], params.dry_penalty_last_n)
    m = len(window)
    if m <= allowed:
        return {}
    # the nearest restart sequence from the end: a head i tokens from the end followed by one of its tails
    limit = m
    for i in range(m):
        tails = breakers.heads.get(window[m - 1 - i], ())
        matched = [len(tail) for tail in tails if len(tail) <= i and tuple(window[m - i:m - i + len(tail)]) == tail]
        if matched:
            limit = i - max(matched)
            break
    if limit < allowed:
        return {}
    longest: dict[int, int] = {}  # token -> the longest repeat it would extend
    for j in range(m - 1):
        n = 0  # how many tokens ending at j equal those ending at the end
        while n <= j and window[j - n] == window[m - 1 - n]:
            n += 1
        n = min(n, limit)
        if n >= allowed:
            token = window[j + 1]
            longest[token] = max(longest.get(token, 0), n)
    clamp = max_exponent(params.dry_base)
    single = breakers.single
    return {token: params.dry_multiplier * params.dry_base ** (min(n - allowed, clamp) if clamp else n - allowed)
            for token, n in longest.items() if token not in single}


def restart_limit(window: torch.Tensor, breakers: DryBreakers) -> int:
    """How many of window's (a 1-D int64 tensor's) last tokens follow its nearest restart sequence (all of them
    without one): the positions holding a head are found at once, then checked from the end for a tail."""
    m = len(window)
    if not breakers.heads:
        return m
    positions = torch.isin(window, breakers.head_ids).nonzero()[:, 0].flip(0).tolist()  # from the end
    for pos in positions:
        i = m - 1 - pos
        after = window[pos + 1:pos + 1 + MAX_TAIL_TOKENS].tolist()
        matched = [len(tail) for tail in breakers.heads[int(window[pos])]
                   if len(tail) <= i and tuple(after[:len(tail)]) == tail]
        if matched:
            return i - max(matched)
    return m


def apply_dry(logits: torch.Tensor, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]]) -> torch.Tensor:
    """logits [B, V] -> a copy with the DRY penalties of the rows that ask for them subtracted (`logits` itself
    when none does): dry_penalties_reference's, for every row at once.

    The rows' windows lie end to end in one tensor. Candidates are the positions j whose token equals their
    window's last; each step extends every live candidate's run by one token where the tokens before it and
    before the end still agree (and its cap, the restart limit or the length where the exponent's clamp makes
    longer runs cost the same, is not reached), so there are as many steps as the longest repeat found (one or
    two in most text)."""
    rows = [i for i, p in enumerate(params) if dry_on(p)]
    if not rows:
        return logits
    windows, kept, limits = [], [], []
    for i in rows:
        p = params[i]
        window = dry_window(prompt_token_ids[i], output_token_ids[i], p.dry_penalty_last_n)
        if len(window) <= p.dry_allowed_length:
            continue
        window_t = torch.tensor(window, dtype=torch.long)
        limit = restart_limit(window_t, p._dry_breakers or NO_BREAKERS)
        if limit < p.dry_allowed_length:
            continue
        windows.append(window_t)
        kept.append(i)
        limits.append(limit)
    if not kept:
        return logits
    lengths = torch.tensor([len(w) for w in windows])
    flat = torch.cat(windows)  # [N]
    starts = torch.cumsum(lengths, 0) - lengths  # [R]
    ends = starts + lengths - 1  # [R]: each window's last position
    owner = torch.repeat_interleave(torch.arange(len(kept)), lengths)  # [N]: its row (of kept)
    allowed = torch.tensor([params[i].dry_allowed_length for i in kept])
    clamps = [max_exponent(params[i].dry_base) for i in kept]
    caps = torch.tensor([min(limit, params[i].dry_allowed_length + clamp) if clamp else limit
                         for i, limit, clamp in zip(kept, limits, clamps, strict=True)])
    positions = torch.arange(len(flat))
    candidate = (flat == flat[ends[owner]]) & (positions != ends[owner])
    pos = positions[candidate]  # [C]: j
    row = owner[candidate]  # [C]
    run = torch.ones_like(pos)  # [C]: the run's length so far (the tokens at j and at the end agree)
    live = torch.arange(len(pos))
    while len(live):
        n = run[live]
        before, before_end = pos[live] - n, ends[row[live]] - n
        extend = (n < caps[row[live]]) & (before >= starts[row[live]])
        extend &= flat[before.clamp(min=0)] == flat[before_end]
        live = live[extend]
        run[live] += 1
    run = torch.minimum(run, caps[row])
    hit = run >= allowed[row]
    if not bool(hit.any()):
        return logits
    vocab = logits.shape[1]
    pos, row, run = pos[hit], row[hit], run[hit]
    token = flat[pos + 1]
    inside = token < vocab
    key = row[inside] * vocab + token[inside]
    keys, where = torch.unique(key, return_inverse=True)
    longest = torch.zeros(len(keys), dtype=torch.long).scatter_reduce(0, where, run[inside], "amax")
    rows_t, tokens = keys // vocab, keys % vocab
    single = torch.tensor([t in (params[kept[r]]._dry_breakers or NO_BREAKERS).single
                           for r, t in zip(rows_t.tolist(), tokens.tolist(), strict=True)], dtype=torch.bool)
    rows_t, tokens, longest = rows_t[~single], tokens[~single], longest[~single]
    exponent = (longest - allowed[rows_t]).double()
    clamp_t = torch.tensor(clamps, dtype=torch.double)[rows_t]
    exponent = torch.where((clamp_t > 0) & (exponent > clamp_t), clamp_t, exponent)
    multiplier = torch.tensor([params[i].dry_multiplier for i in kept], dtype=torch.double)[rows_t]
    base = torch.tensor([params[i].dry_base for i in kept], dtype=torch.double)[rows_t]
    penalty = multiplier * base ** exponent
    out = logits.clone()
    batch_rows = torch.tensor(kept)[rows_t].to(logits.device)
    tokens = tokens.to(logits.device)
    out[batch_rows, tokens] = out[batch_rows, tokens] - penalty.to(logits.device, logits.dtype)
    return out
