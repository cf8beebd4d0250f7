"""What generation returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token under the model (raw logits, before sampling filters), its rank
    (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated answer: its token ids, its text, and why it ended ("stop", "length", "error" (the
    request's RequestOutput.error says why), or None while it runs)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop_token_ids entry or stop string that ended it
    # per generated token: the chosen one and the top-N
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestMetrics:
    """Timestamps (time.perf_counter seconds) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    # speculative decoding: verification steps, draft tokens proposed, drafts accepted, and
    # the times its drafts were paused for not paying (spec_decode/spec_switch.py)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_pauses: int = 0

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens per verification step (the accepted drafts and the target's own token), as
        vLLM's mean acceptance length; None without speculation."""
        if not self.spec_num_drafts:
            return None
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between tokens after the first (None until there are two)."""
        if (self.first_token_time is None or self.last_token_time is None
                or self.num_output_tokens < 2):
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)


def speed_summary(num_prompt_tokens: int, prefill_seconds: float, num_output_tokens: int,
                  decode_seconds: float) -> str:
    """"prefill 17 tokens in 0.21s · decode 64 tokens at 13.4 tok/s" (chat and generate print
    it): prefill up to the first token, decode the tokens after the first over the time since
    the first."""
    rate = ((num_output_tokens - 1) / decode_seconds
            if num_output_tokens > 1 and decode_seconds > 0 else 0.0)
    return (f"prefill {num_prompt_tokens} tokens in {prefill_seconds:.2f}s · "
            f"decode {num_output_tokens} tokens at {rate:.1f} tok/s")


@dataclass
class RequestOutput:
    """A request's prompt and its answer(s) so far; `finished` once every answer has ended. `error`: why the
    request ended early (its answers' finish_reason is then "error"): the model gave it no token to pick, or a
    step failed on this request alone; the engine's other requests go on."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    metrics: RequestMetrics | None = None
    error: str | None = None
    # With SamplingParams.prompt_logprobs = k: one entry per prompt token, the first None (nothing predicts
    # it), each later one the prompt token's Logprob (its rank among all tokens) and the k most likely tokens
    # at that position, from the raw logits (vLLM's RequestOutput.prompt_logprobs). One list per request,
    # whatever n is.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    # The single-answer shortcuts: output.text instead of output.outputs[0].text.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # [dimensions], L2-normalised unless the request said otherwise

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float  # relevance in [0, 1]


@dataclass
class PoolingRequestOutput:
    """An embedding or scoring request's result, shaped like vLLM's (EmbeddingRequestOutput,
    ScoringRequestOutput): `outputs.embedding` or `outputs.score`; None, with `error` saying why, where a
    step failed on this request alone."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput | None
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None


EmbeddingRequestOutput = PoolingRequestOutput
ScoringRequestOutput = PoolingRequestOutput
