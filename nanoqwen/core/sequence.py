"""One answer being generated, as the engine sees it: its tokens, its KV-cache blocks, its state.

A request with n > 1 samples has n sequences; they share the prompt's cache blocks. An embedding or
scoring request is one sequence that is only prefilled: its pooling_params are set, its
sampling_params are None.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoqwen.pooling_params import PoolingParams
from nanoqwen.sample.structured_outputs import GrammarState
from nanoqwen.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds cache blocks; prefilling or decoding
    FORK_PENDING = "fork_pending"  # a sibling of an n > 1 request, waiting for the prompt's prefill
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n answers
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys/values are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    # prefix-cache keys of its full blocks, in order
    block_hashes: list[int] = field(default_factory=list)
    # leading blocks of block_table already offered to the prefix cache
    num_registered_blocks: int = 0
    forks: list[Sequence] = field(default_factory=list)  # siblings to start from this one's prefill
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token or stop string that ended it
    error: str | None = None  # why it ended with finish_reason "error"
    detokenizer: Any = None
    text: str = ""
    logprobs: list[Any] | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    pooling_params: PoolingParams | None = None
    pooled: Any = None  # what the pooler read at the last prompt token (a tensor), once prefilled
    grammar: GrammarState | None = None  # the structured-output constraint's progress, if any
    # the tokens that end it: its stop_token_ids, and the model's end-of-sequence ids unless ignore_eos
    stop_token_ids: frozenset[int] = frozenset()
    # Speculative decoding (spec_decode/proposer.py): the draft tokens to verify in this step after
    # the newest token, and the draft's probabilities for them ([len, V] float32; None when the
    # proposer is deterministic: n-gram, or greedy requests).
    spec_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    # tokens whose keys/values are in the draft model's cache (its own count: the draft catches up
    # on everything the target computed, and after a prefix-cache hit recomputes the prefix)
    num_draft_computed_tokens: int = 0
    # whether its drafts pay (spec_decode/spec_switch.py): tokens per verification step, the latest
    # few; no drafts until the answer has spec_resume_at tokens; the next pause's length (0: the
    # first pause's)
    spec_recent_lengths: list[int] = field(default_factory=list)
    spec_resume_at: int = 0
    spec_pause: int = 0
    # SamplingParams.prompt_logprobs: the request's first sequence (the one that prefills its prompt) holds
    # an entry per prompt token computed so far, the first None (the engine starts it); None otherwise
    prompt_logprobs: list[Any] | None = None
    # the LoRA adapter it runs with: the engine's id of that adapter's load (nanoqwen/lora/manager.py), 0 for the
    # base model alone; part of its prefix-cache keys
    lora_id: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_uncomputed_draft_tokens(self) -> int:
        """Tokens the draft model has yet to compute (speculative decoding)."""
        return self.num_tokens - self.num_draft_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the newest token is missing from the cache (after
        admission or preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def samples_by_argmax(self) -> bool:
        """Whether its next token is the plain argmax of the model's logits: greedy, with no logprobs,
        penalties (DRY included) or grammar (a thinking_token_budget has a GrammarState too), and min_tokens
        reached (so that, once past it, a stop token always ends it). Several such decode steps can then
        run without Python between them (num_scheduler_steps). Not while siblings wait to fork from it: its
        prompt's last token is still to compute, and that step also samples their first tokens
        (ModelRunner.prepare)."""
        p = self.sampling_params
        return (p is not None and p.greedy and p.logprobs is None and self.grammar is None
                and p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0
                and p.dry_multiplier == 0
                and len(self.output_token_ids) >= p.min_tokens and not self.forks)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some of its prompt logprobs are still to compute: its prefill must then run every prompt
        position through the model (no prefix-cache hit) and read their logits."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n: end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
