"""Decide which tokens run in the next step, within the token budget and the KV-cache blocks.

Each step, every running sequence that is decoding contributes its one new token; the rest of
the token budget (max_num_batched_tokens) goes to prompt chunks, first of sequences already
prefilling, then of waiting requests admitted while max_num_seqs and free blocks allow (their
cached prefix is skipped). A long prompt is thus split over several steps (chunked prefill)
and never stalls the others' decoding for more than one step: a step that can admit a waiting
request runs those admissions alone (their first chunks, no decode rows), unless the step before
did (or preempted), so that a new request's first token waits for no one's decoding and decoding
waits at most one step (with requests arriving all the time, it runs every other step).

One request's sequences (its n answers) decode at most max_seqs_per_request_step rows a step; the
others of it sit the step out, those with the fewest tokens going first, so that siblings take turns.
A decode step then grows with one request's n only up to that cap, and another request's first token
waits for short steps only (bench/bench_noisy_neighbour.py measures it); the one step not capped is
the one that finishes an n request's prompt, which samples the first token of all its answers.

When the blocks run out, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed (prompt and answer so far) later.

With speculative decoding, a decoding sequence may get up to num_speculative_tokens more tokens
(and their blocks): the draft tokens the proposer fills in before the step runs, all verified in
one forward. Only while few sequences run (spec_max_batch): in bigger batches a step is no longer
bound by reading the weights and verifying drafts costs more than it saves.

With num_scheduler_steps k > 1 (vLLM's multi-step scheduling), a step of decode rows only, whose
sequences all take the argmax of their logits (Sequence.samples_by_argmax), runs up to k decode
steps in one go, each step's tokens fed to the next without a return to the scheduler: the
blocks for all k tokens are reserved first, and fewer steps run near a sequence's max_tokens or
max_model_len. Its tokens come back together; what follows a stop is dropped.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from nanoqwen.core.block_manager import BlockManager
from nanoqwen.core.sequence import Sequence, SequenceStatus


class ScheduledPrefill(NamedTuple):
    seq: Sequence
    num_tokens: int  # prompt tokens computed this step, from seq.num_computed_tokens on


class ScheduledSpecDecode(NamedTuple):
    seq: Sequence
    num_spec_tokens: int  # draft tokens the proposer may add (slots are reserved for them)


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)  # one token each
    prefill: list[ScheduledPrefill] = field(default_factory=list)
    # decoding with speculation: the newest token and up to num_spec_tokens drafts each
    spec_decode: list[ScheduledSpecDecode] = field(default_factory=list)
    # decode steps run in one go (num_scheduler_steps; > 1 only for a batch of decode rows only)
    num_steps: int = 1

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.spec_decode

    @property
    def num_tokens(self) -> int:
        """Tokens of one step (a multi-step batch runs num_steps such steps)."""
        return (len(self.decode) + sum(1 + s.num_spec_tokens for s in self.spec_decode)
                + sum(p.num_tokens for p in self.prefill))

    @property
    def seqs(self) -> list[Sequence]:
        return self.decode + [s.seq for s in self.spec_decode] + [p.seq for p in self.prefill]


def split_by_request(batch: ScheduledBatch) -> dict[str, ScheduledBatch]:
    """The batch's parts, one a request (its sequences' rows, in the batch's order), in the order the
    requests first appear."""
    parts: dict[str, ScheduledBatch] = {}

    def part(seq: Sequence) -> ScheduledBatch:
        return parts.setdefault(seq.request_id, ScheduledBatch(num_steps=batch.num_steps))

    for seq in batch.decode:
        part(seq).decode.append(seq)
    for spec in batch.spec_decode:
        part(spec.seq).spec_decode.append(spec)
    for prefill in batch.prefill:
        part(prefill.seq).prefill.append(prefill)
    return parts


def merge_batches(batches: list[ScheduledBatch], num_steps: int) -> ScheduledBatch:
    """One batch of the rows of several (split_by_request's parts, some of them)."""
    return ScheduledBatch(decode=[s for b in batches for s in b.decode],
                          prefill=[p for b in batches for p in b.prefill],
                          spec_decode=[s for b in batches for s in b.spec_decode], num_steps=num_steps)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int | None = None,
                 num_speculative_tokens: int = 0, spec_max_batch: int = 0,
                 num_scheduler_steps: int = 1, max_seqs_per_request_step: int | None = None,
                 max_loras: int = 0) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_max_batch = spec_max_batch
        self.num_scheduler_steps = num_scheduler_steps
        self.max_seqs_per_request_step = max_seqs_per_request_step or max_num_seqs
        # the most LoRA adapters running at once (the engine's adapter slots; 0: no adapters)
        self.max_loras = max_loras
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        # whether the next step schedules the running sequences before any admission (after a step of
        # admissions alone, or one that preempted)
        self.running_first = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        if self.waiting and not self.running_first:
            batch = ScheduledBatch()
            self.admit(batch, self.max_num_batched_tokens)
            if batch.prefill:
                self.running_first = True
                return batch
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preemptions = self.num_preemptions
        speculate = self.num_speculative_tokens if len(self.running) <= self.spec_max_batch else 0
        sitting_out = self.sitting_out()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if id(seq) in sitting_out:
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            num_spec = 0
            if speculate and not seq.is_prefilling:
                num_spec = min(self.spec_tokens_allowed(seq, speculate), budget - 1)
                n += num_spec
                if num_spec and not self.block_manager.append_slots(seq,
                                                                    seq.num_computed_tokens + n):
                    n, num_spec = n - num_spec, 0  # drafts never preempt anyone
            while not self.block_manager.append_slots(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]  # the newest; never one already in this batch
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # seq itself was preempted: everything after it was too
            if seq.is_prefilling:
                batch.prefill.append(ScheduledPrefill(seq, n))
            elif num_spec:
                batch.spec_decode.append(ScheduledSpecDecode(seq, num_spec))
            else:
                batch.decode.append(seq)
            budget -= n
            i += 1
        # No admissions in a step that had to preempt, nor alone in the next: the blocks are short, and the
        # sequence just preempted (now first in the queue) would be readmitted ahead of the running ones'
        # next slots, only to be preempted again.
        self.running_first = self.num_preemptions != preemptions
        if not self.running_first:
            self.admit(batch, budget)
        # shortest first: attention groups similar lengths
        batch.decode.sort(key=lambda s: s.num_tokens)
        if self.num_scheduler_steps > 1 and batch.decode and not batch.prefill and not batch.spec_decode:
            batch.num_steps = self.steps_ahead(batch.decode)
        return batch

    def admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Waiting requests join the running ones while max_num_seqs, the token budget and free blocks
        allow, each with its first prompt chunk in `batch` (its cached prefix skipped)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora_id and not self.lora_slot_free(seq.lora_id):
                break  # every adapter slot is taken by running sequences: wait for one to finish
            # prompt logprobs need every prompt position's hidden state: no prefix-cache hit (as vLLM)
            cached = [] if seq.needs_prompt_logprobs else self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(seq, cached, num_cached + n):
                break  # not enough free blocks: wait for running sequences to finish
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.prefill.append(ScheduledPrefill(seq, n))
            budget -= n

    def lora_slot_free(self, lora_id: int) -> bool:
        """Whether a sequence of LoRA adapter lora_id may join the running ones: its adapter already runs, or
        fewer than max_loras adapters do."""
        running = {seq.lora_id for seq in self.running} - {0}
        return lora_id in running or len(running) < self.max_loras

    def sitting_out(self) -> set[int]:
        """The ids of the decoding sequences that wait this step: of each request, those past its first
        max_seqs_per_request_step by fewest tokens (then admission order)."""
        if len(self.running) <= self.max_seqs_per_request_step:
            return set()
        decoding: dict[str, list[Sequence]] = defaultdict(list)
        for seq in self.running:
            if not seq.is_prefilling:
                decoding[seq.request_id].append(seq)
        cap, out = self.max_seqs_per_request_step, set()
        for seqs in decoding.values():
            if len(seqs) > cap:
                out.update(id(seq) for seq in sorted(seqs, key=lambda s: s.num_tokens)[cap:])
        return out

    def steps_ahead(self, seqs: list[Sequence]) -> int:
        """How many decode steps seqs run in one go: up to num_scheduler_steps while every one
        takes the argmax of its logits, no more than any of them has tokens left, and 1 when the
        blocks for the steps ahead are short (they never preempt anyone)."""
        if not all(seq.samples_by_argmax for seq in seqs):
            return 1
        k = min(self.tokens_left(seq, self.num_scheduler_steps) for seq in seqs)
        if k <= 1:
            return 1
        for i, seq in enumerate(seqs):
            if not self.block_manager.append_slots(seq, seq.num_computed_tokens + k):
                for reserved in seqs[:i]:  # back to one step's blocks
                    self.block_manager.trim(reserved)
                return 1
        return k

    def tokens_left(self, seq: Sequence, most: int) -> int:
        """Tokens seq may still generate (its max_tokens, max_model_len), at most `most`."""
        left = self.max_model_len - seq.num_tokens if self.max_model_len else most
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - len(seq.output_token_ids))
        return min(left, most)

    def spec_tokens_allowed(self, seq: Sequence, k: int) -> int:
        """Draft tokens worth proposing for seq: at most k, none under a grammar (structured
        outputs are not speculated) or while its drafts are paused for not paying
        (spec_decode/spec_switch.py), and fewer near its end: the step's last token is always the
        target's own, so drafts beyond max_tokens or max_model_len would be wasted."""
        if seq.grammar is not None or len(seq.output_token_ids) < seq.spec_resume_at:
            return 0
        return max(0, self.tokens_left(seq, k + 1) - 1)

    def preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_draft_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def start_forked(self, seq: Sequence) -> None:
        """A sibling that got its cache from fork() joins the running sequences."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
