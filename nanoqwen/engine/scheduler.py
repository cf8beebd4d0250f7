"""Decide which tokens run in the next step.

Every step, each running sequence that is decoding contributes its one new token; the rest of
the token budget (max_num_batched_tokens) goes to prompt chunks, first of sequences already
prefilling, then of waiting requests that get a free KV-cache slot. A long prompt is thus
split over several steps (chunked prefill) and never stalls the others' decoding.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from nanoqwen.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)  # one token each
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.free_slots = list(range(max_num_seqs))  # a min-heap: low slots first keeps decode slots consecutive
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        for seq in self.running:
            if not seq.is_prefilling:
                batch.decode.append(seq)
                budget -= 1
        for seq in self.running:
            if seq.is_prefilling and budget > 0:
                n = min(seq.num_uncomputed_tokens, budget)
                batch.prefill.append((seq, n))
                budget -= n
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self.free_slots)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.prefill.append((seq, n))
            budget -= n
        batch.decode.sort(key=lambda s: s.slot)
        return batch

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's slot."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            heapq.heappush(self.free_slots, seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.slot = None
