"""One request as the engine sees it: its tokens, how many are in the KV cache, and its state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from nanoqwen.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet given a KV-cache slot
    RUNNING = "running"  # has a slot; prefilling or decoding
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    num_computed_tokens: int = 0  # tokens whose keys/values are already in the cache
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while the prompt is not fully in the cache (decoding feeds exactly one new token)."""
        return self.num_uncomputed_tokens > 1

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]
