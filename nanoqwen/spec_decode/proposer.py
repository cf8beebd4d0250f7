"""Proposers for speculative decoding: before a step runs, each sequence scheduled with draft slots
gets up to that many draft tokens (`seq.spec_token_ids`), which the step verifies in one forward
(nanoqwen/sample/rejection_sampler.py).

- NgramProposer: prompt lookup. The answer's last n tokens (n from prompt_lookup_max down to
  prompt_lookup_min) are searched earlier in the prompt and answer; the tokens that followed an
  earlier occurrence (the latest with k tokens after it) are the drafts. No model, no cache: it
  pays where answers repeat their input (code edits, quotes, summaries).
- DraftModelProposer: a second, cheaper model (a smaller Qwen3, or the target's own weights
  quantised to int8/int4) generates the drafts autoregressively. It has its own KV cache with the
  target's block layout: the same block tables and slots, so the scheduler's blocks hold both models'
  keys and values and preemption or finishing frees both. Before drafting, the draft model catches
  up on every token the target has that it has not computed (the whole prompt the first time, and
  usually one or two tokens after a step). It must read and write the target's token ids
  (check_same_tokenizer, at start).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from nanoqwen.attention.metadata import DecodeRow, PrefillRow
from nanoqwen.core.scheduler import ScheduledSpecDecode
from nanoqwen.core.sequence import Sequence
from nanoqwen.errors import ConfigError
from nanoqwen.sample.sampler import argmax, dense_probs
from nanoqwen.tokenizer import Tokenizer
from nanoqwen.worker.model_runner import ModelRunner, StepInput

# a draft catch-up of at most this many tokens runs as decode rows (one per token)
SHORT_CATCH_UP = 4


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, scheduled: list[ScheduledSpecDecode]) -> None:
        for seq, k in scheduled:
            seq.spec_token_ids = self.lookup(seq.prompt_token_ids + seq.output_token_ids, k)
            seq.draft_probs = None  # certain: q is one-hot

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the longest suffix of token_ids
        (max_n .. min_n tokens long) found: the latest occurrence followed by k tokens, else the
        one followed by the most (in a loop the latest is followed by only a few); [] when none
        occurs."""
        tokens = np.asarray(token_ids)
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n:]
            # candidate starts i < total - n whose n tokens equal the suffix
            starts = np.flatnonzero(tokens[: total - n] == suffix[0])
            best: list[int] = []
            for i in starts[::-1]:  # the latest first
                if np.array_equal(tokens[i:i + n], suffix):
                    following = tokens[i + n: i + n + k].tolist()
                    if len(following) > len(best):
                        best = following
                    if len(best) == k:
                        break
            if best:
                return best
        return []


class DraftModelProposer:
    """runner: the draft model's ModelRunner, whose KV cache has the target's number of blocks and
    block size. max_chunk: the most tokens of one sequence the draft computes in one forward while
    catching up (the engine's max_num_batched_tokens)."""

    def __init__(self, runner: ModelRunner, max_chunk: int) -> None:
        self.runner = runner
        self.max_chunk = max_chunk

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledSpecDecode]) -> None:
        seqs = [seq for seq, _ in scheduled]
        logits = self._catch_up(seqs)  # [B, V]: after each sequence's newest token
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for step in range(max(k for _, k in scheduled)):
            for row, i in enumerate(active):
                token, q = self._draw(seqs[i], logits[row])
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if len(drafts[i]) < scheduled[i].num_spec_tokens]
            if not active:
                break
            # each active sequence's latest draft at position num_tokens + step
            step_input = StepInput(input_ids=[drafts[i][-1] for i in active], prefill=[],
                                   decode=[DecodeRow(seqs[i].block_table,
                                                     seqs[i].num_tokens + step + 1)
                                           for i in active],
                                   sample_rows=list(range(len(active))))
            logits = self.runner.forward(step_input)
        for i, seq in enumerate(seqs):
            seq.spec_token_ids = drafts[i]
            seq.draft_probs = torch.stack(probs[i]) if probs[i] else None
            seq.num_draft_computed_tokens = seq.num_tokens + len(drafts[i]) - 1

    def _catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run the draft model over each sequence's tokens it has not computed (up to and with the
        newest), in chunks of at most max_chunk; logits [B, V] after each newest token.

        After a verification step that is one or two tokens: those go as decode rows, one per token
        (as the target verifies drafts: worker/model_runner.py), so the step takes the decode path;
        a longer catch-up (a new prompt) goes as a prompt chunk."""
        rows: dict[int, torch.Tensor] = {}
        while len(rows) < len(seqs):
            step = StepInput(input_ids=[], decode=[], prefill=[], sample_rows=[])
            todo = [i for i in range(len(seqs)) if i not in rows]
            short = [i for i in todo if seqs[i].num_uncomputed_draft_tokens <= SHORT_CATCH_UP]
            order = []  # which sequence each sample row is
            for i in short:  # decode rows come first in a step
                seq = seqs[i]
                start, end = seq.num_draft_computed_tokens, seq.num_tokens
                step.input_ids += seq.token_ids(start, end)
                step.decode += [DecodeRow(seq.block_table, p + 1) for p in range(start, end)]
                seq.num_draft_computed_tokens = end
                step.sample_rows.append(len(step.input_ids) - 1)
                order.append(i)
            for i in todo:
                if i in short:
                    continue
                seq = seqs[i]
                start = seq.num_draft_computed_tokens
                end = min(seq.num_tokens, start + self.max_chunk)
                step.input_ids += seq.token_ids(start, end)
                step.prefill.append(PrefillRow(seq.block_table, start, end - start))
                seq.num_draft_computed_tokens = end
                if end == seq.num_tokens:
                    step.sample_rows.append(len(step.input_ids) - 1)
                    order.append(i)
            logits = self.runner.forward(step)
            for i, row in zip(order, logits if logits is not None else [], strict=True):
                rows[i] = row
        return torch.stack([rows[i] for i in range(len(seqs))])

    @staticmethod
    def _draw(seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft's token after these logits [V] and the distribution it came from (None for a
        greedy request: its argmax, certain). The draft samples with the request's temperature and
        filters, so its q is close to the target's p."""
        params = seq.sampling_params
        if params.greedy:
            return int(argmax(logits[None])[0]), None
        q = dense_probs(logits[None], [params])[0]  # [V]
        return int(torch.multinomial(q, 1, generator=seq.generator)), q


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, target_vocab_size: int,
                         draft_vocab_size: int, draft_dir: Path) -> None:
    """A ConfigError unless the draft model reads and writes the same token ids as the target
    (the same vocabulary and the same logits width)."""
    fix = "a draft model must share the target's tokenizer (every Qwen3 size does)"
    if draft_vocab_size != target_vocab_size:
        raise ConfigError(f"the draft model {draft_dir} has vocab_size {draft_vocab_size}, the "
                          f"target {target_vocab_size}: {fix}")
    theirs, ours = draft.backend.get_vocab(with_added_tokens=True), \
        target.backend.get_vocab(with_added_tokens=True)
    if theirs != ours:
        diff = next((t for t in ours if theirs.get(t) != ours[t]), None) \
            or next(t for t in theirs if t not in ours)
        raise ConfigError(f"the draft model {draft_dir}'s tokenizer differs from the target's "
                          f"(token {diff!r} is id {theirs.get(diff)} there, {ours.get(diff)} "
                          f"here): {fix}")
