"""Turn the last-position logits of a batch into one token per sequence, each with its own params.

Each row goes through these steps, with its own SamplingParams:

0. structured outputs: a constrained row's tokens outside its grammar's bitmask get -inf
   (nanoqwen/sample/structured_outputs.py); everything below sees only the allowed tokens. A row whose
   thinking_token_budget is spent gets a bitmask of </think> alone the same way.
a. logprobs (rows that ask for them) come from the RAW model logits: log_softmax in float32
   before any penalty, temperature or filter (vLLM's default "raw_logprobs" mode).
b. min_tokens: while the row has fewer output tokens than min_tokens, its stop token ids
   (eos unless ignore_eos, plus params.stop_token_ids, as the engine passes them) get -inf;
   unless that leaves the row no token at all (its grammar allows nothing but a stop: the
   answer is complete), where the grammar's end wins.
c. repetition_penalty over every token seen in the prompt or the output (a logit > 0 is
   divided by it, one <= 0 multiplied, as in HF/vLLM), then presence_penalty and
   frequency_penalty over the output tokens
   (OpenAI: logit -= presence * (count > 0) + frequency * count), then DRY (dry_multiplier > 0: a token
   that would extend a repeat of earlier context loses multiplier * base ** (length - allowed_length);
   nanoqwen/sample/dry.py).
d. greedy rows (temperature 0) take the argmax of these logits; the others are filtered in
   transformers' order (temperature, top_k, top_p, min_p; tied values kept together at each
   cut) and sampled with the exponential-race trick (argmax of p / Exp(1) noise is a sample from
   p), each token's noise made from a key drawn from the request's own generator and the token's
   id: the same seed gives the same tokens whether the request runs alone or in a batch. top_p
   needs no sort: each row's threshold comes from a radix select (ops/cpu: top_p_threshold) beside
   its sorting reference (top_p_threshold_reference); the race runs in one pass
   (ops/cpu: exponential_race) beside exponential_race_reference.

Steps b and c live in nanoqwen/sample/penalties.py (DRY in dry.py); they cost nothing (no copy) when no row
of the batch uses them.

A row left with nothing to pick (its logits NaN, +inf or all -inf, so the chosen token's logit, or
its probability, is not a finite positive one) gets BROKEN_ROW instead of a token: an answer ends
there with an error (nanoqwen/engine/output_processor.py), never with a made-up token 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.sample.penalties import adjust_logits
from nanoqwen.sample.structured_outputs import apply_bitmasks
from nanoqwen.sampling_params import SamplingParams


@dataclass
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw model logits
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # (token id, logprob), the `logprobs` most likely, best first


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: list[TokenLogprobs | None]  # [B]; None where the row did not ask for logprobs


ARGMAX_BLOCK = 128  # values per block in argmax's CPU path
BROKEN_ROW = -1  # the "token" of a row whose logits leave nothing to pick


def argmax(values: torch.Tensor) -> torch.Tensor:
    """values [B, V] -> [B] int64, each row's index of its largest value: torch.argmax's answer
    (the first index on ties; a NaN counts as the largest), found faster on CPU.

    torch's CPU argmax walks a row one value at a time, while its amax is vectorised (over Qwen3's
    151,936 logits that is a noticeable part of a decode step). Where nanoqwen's CPU kernels
    are loaded, one call of its argmax (ops/cpu/kernels.py: a vectorised max, then its first index).
    Otherwise, when V is a multiple of the block: the max of each block of 128 values [B, V/128],
    the first block holding the row's max (a plain argmax over V/128 values), then the first max
    inside that block. The first block holding the max holds its first index, so the answer is
    torch.argmax's (tests/sample/test_sampler.py checks ties, NaN and -inf rows on every path).
    """
    rows, vocab = values.shape
    if not values.is_cpu or rows == 0 or vocab == 0:
        return values.argmax(dim=-1)
    if values.dtype == torch.float32 and cpu_kernels.loaded():
        return cpu_kernels.argmax(values)
    if vocab % ARGMAX_BLOCK:
        return values.argmax(dim=-1)
    blocks = values.reshape(rows, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)  # [B, V/128, 128]
    block = blocks.amax(dim=-1).argmax(dim=-1)  # [B]
    inside = blocks[torch.arange(rows), block].argmax(dim=-1)  # [B]
    return block * ARGMAX_BLOCK + inside


def filter_probs(logits: torch.Tensor, params: list[SamplingParams],
                 normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities over each row's kept candidates, in token order: (probs [B, K], token ids [B, K]);
    normalize=False leaves the kept ones as they were before the cuts (a draw needs no more).

    K is the largest top_k when every row has one (its candidates: the K best, put back in token
    order), else the vocabulary. Each cut keeps the tokens tied with the last one kept, so a row
    keeps the same tokens whatever K its batch gives it.
    """
    b, vocab = logits.shape
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temperature[:, None]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]  # (any k >= V: all)
    token_ids = torch.arange(vocab, device=device).expand(b, vocab)
    if min(top_k) < vocab:
        k = max(top_k)
        best, best_ids = logits.topk(min(k + 1, vocab), dim=-1)  # [B, k + 1], largest first
        kth = best.gather(1, torch.tensor(top_k, device=device)[:, None] - 1)  # [B, 1]
        # When every row has a top_k, only the K best can stay: K from k on, doubled while some
        # row's tie with its k-th value runs past them (bf16 logits tie often).
        # (a k-th value of -inf, as a grammar allowing fewer than k tokens leaves, is no tie to follow)
        while k < vocab and not bool(((best[:, k:] < kth) | kth.isneginf()).all()):
            k = min(2 * k, vocab)
            best, best_ids = logits.topk(min(k + 1, vocab), dim=-1)
        if k < vocab:
            token_ids = best_ids[:, :k].sort(dim=-1).values  # [B, K]
            logits = logits.gather(1, token_ids)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    # top_p, then min_p (a fraction of the top probability, which top_p always keeps): one cut a row
    cut = torch.zeros(b, device=device, dtype=probs.dtype)  # [B]: the smallest probability kept
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1]
    if len(top_p_rows) == b:
        cut = top_p_threshold(probs, torch.tensor([p.top_p for p in params], device=device))
    elif top_p_rows:
        rows = torch.tensor(top_p_rows, device=device)
        top_p = torch.tensor([params[i].top_p for i in top_p_rows], device=device)
        cut[rows] = top_p_threshold(probs[rows], top_p)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
        cut = torch.maximum(cut, min_p * probs.amax(dim=-1))
    if top_p_rows or any(p.min_p > 0 for p in params):
        probs = probs.masked_fill(probs < cut[:, None], 0.0)
    return (probs / probs.sum(-1, keepdim=True) if normalize else probs), token_ids


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs float32 [B, V] (>= 0, each row summing to 1), top_p [B] -> [B]: what
    top_p_threshold_reference gives, by nanoqwen's CPU kernel where it is loaded (a radix select
    over each row, no sort)."""
    if probs.is_cpu and probs.dtype == torch.float32 and cpu_kernels.loaded():
        return cpu_kernels.top_p_threshold(probs, top_p)
    return top_p_threshold_reference(probs, top_p)


def top_p_threshold_reference(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's top-p threshold [B] float32: its smallest positive value t whose greater values
    sum to at most top_p (in float64). Keeping the values >= t keeps the most likely tokens until
    the ones above reach top_p, tied values together (the first always stays); a row holding a
    NaN gets NaN, a row with no positive value 0. Sorts each row."""
    values = probs.double().nan_to_num(0.0).sort(dim=-1, descending=True).values  # [B, V] (NaN rows: below)
    above = values.cumsum(dim=-1) - values  # [B, V]: the mass ranked above each, in sort order
    # a tied value's greater values are those above the first of its run
    first = torch.searchsorted(-values, -values, side="left")  # [B, V]
    greater = above.gather(1, first)
    kept = ((greater <= top_p.double()[:, None]) & (values > 0)).sum(dim=-1)  # a prefix of each row
    threshold = values.gather(1, (kept - 1).clamp(min=0)[:, None])[:, 0].float()  # [B]
    threshold = threshold.masked_fill(kept == 0, 0.0)
    return threshold.masked_fill(probs.isnan().any(dim=-1), float("nan"))


def draw(probs: torch.Tensor, token_ids: torch.Tensor | None,
         generators: list[torch.Generator | None]) -> torch.Tensor:
    """probs [R, K] (each row's kept candidates), token_ids [R, K] (None: column k is token k) -> [R]
    int64: each row's sample, the column of its largest probability over an Exp(1) draw (the
    exponential race: a sample from the row's distribution). The draws come from one key a row,
    taken from the row's own generator (the global one where None), and each token's id: a seeded
    row's token never depends on the other rows, on the columns its batch gives it, or on small
    rounding differences in its probabilities (the winner leads by a margin, unlike a cumulative
    sum's boundary). By nanoqwen's CPU kernel where it is loaded (no [R, K] noise tensor)."""
    keys = torch.cat([torch.randint(0, 2**62, (1,), generator=g, device=g.device if g is not None else "cpu")
                      .to(probs.device) for g in generators])  # [R]
    if probs.is_cpu and probs.dtype == torch.float32 and cpu_kernels.loaded():
        return cpu_kernels.exponential_race(probs, token_ids, keys)
    return exponential_race_reference(probs, token_ids, keys)


def exponential_race_reference(probs: torch.Tensor, token_ids: torch.Tensor | None,
                               keys: torch.Tensor) -> torch.Tensor:
    """draw's choice with tensor operations: argmax of probs / exponential_noise."""
    if token_ids is None:
        token_ids = torch.arange(probs.shape[1], device=probs.device).expand(probs.shape)
    return (probs / exponential_noise(keys, token_ids)).argmax(dim=-1)


# splitmix64's constants, as int64 (two's complement) for tensor arithmetic, which wraps like uint64
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def exponential_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """keys [R] int64, token_ids [R, K] -> Exp(1) noise [R, K] float32: -log(u), u = race_uniform of
    splitmix64 of key + (token id + 1) * golden ratio (a counter-based generator: any token's draw is
    computed alone)."""
    def shift(z: torch.Tensor, bits: int) -> torch.Tensor:  # a logical right shift of int64 bits
        return (z >> bits) & ((1 << (64 - bits)) - 1)

    z = keys[:, None] + (token_ids + 1) * _GOLDEN
    z = (z ^ shift(z, 30)) * _MIX1
    z = (z ^ shift(z, 27)) * _MIX2
    return -race_uniform(z ^ shift(z, 31)).log()


def race_uniform(bits: torch.Tensor) -> torch.Tensor:
    """64 random bits (int64) -> a float32 uniform in (0, 1) from the top 23: (m + 0.5) / 2^23, exact in
    float32 (with 24 bits the largest would round up to 1, whose noise is 0)."""
    return ((((bits >> 41) & ((1 << 23) - 1)).double() + 0.5) * 2.0**-23).float()


def compute_logprobs(raw_logits: torch.Tensor, params: list[SamplingParams],
                     tokens: torch.Tensor) -> list[TokenLogprobs | None]:
    """The sampled tokens' log-probabilities, ranks and top alternatives under the raw logits;
    see step a."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    rows_t = torch.tensor(rows, device=raw_logits.device)
    picked = raw_logits if len(rows) == len(params) else raw_logits[rows_t]  # (index_select is slower on CPU)
    logprobs = picked.float().log_softmax(dim=-1)  # [R, V]
    chosen = tokens.index_select(0, rows_t)[:, None]  # [R, 1]
    chosen_logprob = logprobs.gather(1, chosen)  # [R, 1]
    rank = 1 + (logprobs > chosen_logprob).sum(dim=-1)  # [R]
    top_n = max(params[i].logprobs or 0 for i in rows)
    top_logprobs, top_ids = logprobs.topk(top_n, dim=-1)  # [R, N], best first
    results = zip(rows, chosen[:, 0].tolist(), chosen_logprob[:, 0].tolist(), rank.tolist(),
                  top_ids.tolist(), top_logprobs.tolist(), strict=True)
    for i, token, logprob, r, ids, lps in results:
        n = params[i].logprobs or 0
        out[i] = TokenLogprobs(token, logprob, r, list(zip(ids[:n], lps[:n], strict=True)))
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
           stop_token_ids: list[set[int]],
           bitmasks: list[torch.Tensor | None] | None = None) -> SamplerOutput:
    """logits [B, V] float32 (not modified) -> the next token of every row, plus logprobs where
    asked.

    prompt_token_ids / output_token_ids: each row's tokens so far (for penalties and min_tokens);
    stop_token_ids: each row's stop ids (eos unless ignore_eos, plus params.stop_token_ids);
    bitmasks: each row's allowed tokens under its grammar (None: unconstrained); see step 0.
    """
    if bitmasks is not None:
        logits = apply_bitmasks(logits, bitmasks)
    raw_logits = logits
    logits = adjust_logits(logits, params, prompt_token_ids, output_token_ids, stop_token_ids)
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)  # [B]
    for greedy in (True, False):
        rows = [i for i, p in enumerate(params) if p.greedy == greedy]
        if not rows:
            continue
        row_logits = logits[rows] if len(rows) < len(params) else logits
        if greedy:
            tokens[rows] = greedy_tokens(row_logits)
            continue
        probs, token_ids = filter_probs(row_logits, [params[i] for i in rows], normalize=False)  # [R, K], [R, K]
        whole = token_ids.shape[1] == logits.shape[1]  # (then column k is token k)
        choice = draw(probs, None if whole else token_ids, [generators[i] for i in rows])[:, None]  # [R, 1]
        # no distribution to sample from (NaN or all 0): BROKEN_ROW
        tokens[rows] = token_ids.gather(1, choice)[:, 0].masked_fill(~(probs.gather(1, choice)[:, 0] > 0),
                                                                      BROKEN_ROW)
    broken = tokens == BROKEN_ROW
    logprobs = compute_logprobs(raw_logits, params, tokens.clamp(min=0))
    if broken.any():
        logprobs = [None if bad else lp for bad, lp in zip(broken.tolist(), logprobs, strict=True)]
    return SamplerOutput(tokens, logprobs)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> each row's argmax [B], or BROKEN_ROW where that logit is not finite (NaN, or a row of
    -inf): the sampler's choice for a greedy row with nothing to adjust."""
    tokens = argmax(logits)
    return tokens.masked_fill(~torch.isfinite(logits.gather(1, tokens[:, None])[:, 0]), BROKEN_ROW)


def dense_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's sampling distribution over the whole vocabulary, [B, V] float32: what step d
    samples from (temperature, top_k, top_p, min_p applied; 0 outside the kept candidates)."""
    probs, token_ids = filter_probs(logits, params)
    return torch.zeros_like(logits, dtype=probs.dtype).scatter_(1, token_ids, probs)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: list[int],
                            num_logprobs: list[int]) -> list[TokenLogprobs]:
    """Prompt logprobs (SamplingParams.prompt_logprobs) of some prompt positions: logits [R, V] at each
    position, target_ids [R] the prompt token that follows it, num_logprobs [R] how many of the most likely
    tokens each row lists -> per row the target's log-probability under these raw logits (log_softmax in
    float32, as the sampled tokens' in step a), its rank and the top ones."""
    logprobs = logits.float().log_softmax(dim=-1)  # [R, V]
    targets = torch.tensor(target_ids, device=logits.device)[:, None]  # [R, 1]
    target_logprob = logprobs.gather(1, targets)  # [R, 1]
    rank = 1 + (logprobs > target_logprob).sum(dim=-1)  # [R]
    top_logprobs, top_ids = logprobs.topk(max(num_logprobs, default=0), dim=-1)  # [R, K], best first
    rows = zip(target_ids, target_logprob[:, 0].tolist(), rank.tolist(), top_ids.tolist(), top_logprobs.tolist(),
               num_logprobs, strict=True)
    return [TokenLogprobs(token, logprob, r, list(zip(ids[:k], lps[:k], strict=True)))
            for token, logprob, r, ids, lps, k in rows]
