"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from nanoqwen.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """temperature 0 means greedy; top_k -1 (or 0), top_p 1 and min_p 0 turn each filter off.

    Filters apply in transformers' order: temperature, top_k, top_p, min_p.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to the context length
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def bad(field: str, value: object, rule: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{field}={value!r} is invalid: {rule}")

        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be an integer >= 1, or -1 / 0 to disable")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None and (
                not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1 (or None for no limit)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", self.seed, "must be an integer or None")
        if self.stop_token_ids is not None and not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be a list of token ids (integers >= 0)")
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
