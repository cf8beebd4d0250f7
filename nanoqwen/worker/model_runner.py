"""Run one scheduled step on the model: pack the tokens, run the forward, sample the next tokens.

Nothing here changes a sequence: what happens to sequences after a step happens in one place,
LLMEngine._postprocess. With tensor parallelism every rank runs `run_model` on the same
`StepInput`: rank 0 builds it from the scheduled batch and broadcasts it, the workers
(worker/tp_worker.py) receive it. Only rank 0 samples.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

import nanoqwen.distributed as distributed
from nanoqwen.attention.backends.paged import attention_backend
from nanoqwen.attention.kv_cache import KVCache
from nanoqwen.attention.metadata import AttentionMetadata, DecodeRow, PrefillRow, padded_block_tables
from nanoqwen.core.scheduler import ScheduledBatch
from nanoqwen.core.sequence import Sequence
from nanoqwen.layers.pooler import Pooler
from nanoqwen.lora.manager import LoRAManager, LoRASync
from nanoqwen.models.qwen3 import Qwen3ForCausalLM
from nanoqwen.sample.rejection_sampler import rejection_sample
from nanoqwen.sample.sampler import BROKEN_ROW, TokenLogprobs, compute_prompt_logprobs, greedy_tokens, sample
from nanoqwen.worker.cuda_graph import CUDAGraphRunner
from nanoqwen.worker.fused_decoder import FusedDecoder
from nanoqwen.worker.huge_pages import move_to_huge_pages

logger = logging.getLogger("nanoqwen")
# prompt positions per LM head call when computing prompt logprobs: their float32 logits [rows, V] at a time
PROMPT_LOGPROBS_ROWS = 256


class PromptLogprobRows(NamedTuple):
    """A prompt chunk's rows whose logits give prompt logprobs (SamplingParams.prompt_logprobs): the step's rows
    first_row, first_row + 1, ..., one per target_ids entry (the prompt token that row's position predicts;
    the first is prompt token first_token)."""

    request_id: str
    first_token: int
    first_row: int
    target_ids: list[int]
    num_logprobs: int


class PromptLogprobs(NamedTuple):
    """Prompt logprobs a step computed for a request: logprobs[i] is prompt token first_token + i's."""

    request_id: str
    first_token: int
    logprobs: list[TokenLogprobs]


@dataclass
class StepInput:
    """What a forward needs, as plain data (rank 0 sends it to the other ranks)."""

    input_ids: list[int]  # decode tokens first, then the prompt chunks
    decode: list[DecodeRow]
    prefill: list[PrefillRow]
    sample_rows: list[int]  # rows whose next token is sampled (their logits are computed)
    # (src, dst) KV blocks to copy first
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # False: logits in the LM head's own dtype, when every sampled row takes their argmax (exact in bf16; no
    # float32 copy of [rows, V])
    float32_logits: bool = True
    # prompt chunks whose positions' logits give prompt logprobs (every rank runs them through its LM head)
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)
    # each row's LoRA adapter (Sequence.lora_id, 0: none); empty when no row has one
    lora_ids: list[int] = field(default_factory=list)
    # with tensor parallelism: the LoRA adapters and slots the workers take before this step (rank 0's
    # LoRAManager.sync_for_workers); None when nothing changed for them
    lora_sync: LoRASync | None = None


class SampledTokens(NamedTuple):
    """A sequence's new tokens from a step: one, or with speculative decoding the accepted draft
    tokens and then one of the target's."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per token (None where the request asked for none)


class PooledOutput(NamedTuple):
    """An embedding or scoring sequence's result, read at its last prompt token: the float32
    hidden state [H] or the score []."""

    seq: Sequence
    data: torch.Tensor


class ModelRunner:
    """Owns the model and its KV cache. On CUDA, decode attention reads the cache in place
    (attention/backends/paged.py) and, unless enforce_eager, pure decode steps replay CUDA graphs
    (worker/cuda_graph.py).

    pooler: an embedding or scoring model's (nanoqwen/config/pooling.py): the rows read at each prompt's
    last token go through it instead of the LM head and the sampler; such models never decode.
    """

    def __init__(self, model: Qwen3ForCausalLM, num_blocks: int, block_size: int, *,
                 max_num_seqs: int = 64, max_model_len: int | None = None,
                 enforce_eager: bool = False, pooler: Pooler | None = None,
                 lora: LoRAManager | None = None, kv_cache_dtype: str = "auto") -> None:
        self.model = model
        # the engine's LoRA adapters: a step whose rows have adapters sets them before the forward (lora_ids)
        self.lora = lora
        self.pooler = pooler
        self.device = model.device
        if self.device.type == "cpu":  # each decode step streams every weight: 2 MiB pages (worker/huge_pages.py)
            move_to_huge_pages(model)
        c = model.config
        # None: the CPU grouped gather path; "cpu": nanoqwen's kernel reading the CPU cache in place
        self.attention_backend = attention_backend(self.device, block_size, model.dtype,
                                                   cpu_kernels_on=model.kernels.matmul.gemv,
                                                   kv_cache_dtype=kv_cache_dtype)
        # Graphs need the paged kernels; on CPU they are never captured
        # (NANOQWEN_PAGED_ATTENTION=torch runs the same padded static-buffer steps eagerly there,
        # for tests). Not with tensor parallelism (yet): its collectives would have to be captured
        # in the graphs too. Not for MoE models: the expert dispatch reads each expert's token count
        # on the host (models/qwen3.py, Experts), which a graph capture forbids.
        use_runner = (not enforce_eager and self.attention_backend not in (None, "cpu")
                      and model.tp_size == 1 and not c.is_moe and pooler is None)
        if not enforce_eager and self.device.type == "cuda" and c.is_moe:
            logger.info("CUDA graphs are off for this MoE model: "
                        "its expert dispatch syncs with the host")
        # One extra block, never handed out by the block manager: graph padding rows write their
        # keys/values there.
        self.kv_cache = KVCache(c.num_hidden_layers, num_blocks + use_runner, block_size,
                                model.num_kv_heads, c.head_dim, model.dtype,
                                self.device, kv_cache_dtype)
        # made since the last step, for the other ranks
        self._block_copies: list[tuple[int, int]] = []
        # computed since the engine last took them (take_prompt_logprobs); rank 0 only
        self.prompt_logprobs: list[PromptLogprobs] = []
        self.graph_runner: CUDAGraphRunner | None = None
        # CPU decode steps: all decoder layers in one C++ call, where the model allows (worker/fused_decoder.py)
        self.fused_decoder = (FusedDecoder(model) if pooler is None and FusedDecoder.supports(
            model, self.attention_backend) else None)
        if use_runner:
            max_blocks = -(-(max_model_len or c.max_position_embeddings) // block_size)
            self.graph_runner = CUDAGraphRunner(model, self.kv_cache, num_blocks * block_size,
                                                max_num_seqs, max_blocks, self.attention_backend,
                                                use_graphs=self.device.type == "cuda")
            start = time.perf_counter()
            self.graph_runner.capture()
            if self.graph_runner.use_graphs:
                logger.info("captured %d CUDA graphs (decode batch sizes %s) in %.1f s",
                            len(self.graph_runner.graphs), self.graph_runner.batch_sizes,
                            time.perf_counter() - start)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy a KV block (a forked sequence's partly filled one); the other ranks copy theirs next
        step."""
        self.kv_cache.copy_block(src, dst)
        if self.model.tp_size > 1:
            self._block_copies.append((src, dst))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[SampledTokens] | list[PooledOutput]:
        """Pack -> forward -> sample: the next token of every sequence that reached its next token
        (with a pooler: the pooled result of every sequence whose prompt finished); a sequence with
        draft tokens gets those of them the target accepts and one more (rejection_sampler.py).

        A prompt chunk that does not finish its prompt produces no token: only its K/V are cached. A
        sequence whose prompt finishes here also samples the first token of each sibling waiting to
        fork.
        """
        if batch.num_steps > 1:
            return self.greedy_steps(batch.decode, batch.num_steps)
        step, seqs, verify = self.prepare(batch)
        logits = self.forward(step)
        if logits is None:
            return []
        if self.pooler is not None:
            return [PooledOutput(seq, row) for seq, row in zip(seqs, logits, strict=True)]
        out = []
        if seqs and not step.float32_logits:
            out = [SampledTokens(seq, [token], [None])
                   for seq, token in zip(seqs, greedy_tokens(logits).tolist(), strict=True)]
        elif seqs:
            sampled = sample(logits[: len(seqs)], *self._sampling_inputs(seqs),
                             [s.grammar.bitmask() if s.grammar is not None else None for s in seqs])
            rows = zip(seqs, sampled.token_ids.tolist(), sampled.logprobs, strict=True)
            out = [SampledTokens(seq, [token], [lp]) for seq, token, lp in rows]
        if verify:
            verified = rejection_sample(logits[len(seqs):], [s.spec_token_ids for s in verify],
                                        [s.draft_probs for s in verify],
                                        *self._sampling_inputs(verify))
            out += [SampledTokens(s, *v) for s, v in zip(verify, verified, strict=True)]
        return out

    def greedy_steps(self, seqs: list[Sequence], num_steps: int) -> list[SampledTokens]:
        """Up to num_steps decode steps of seqs, which all take the argmax of their logits
        (Sequence.samples_by_argmax; their blocks cover every step): each step's tokens are the next
        step's input. Stops early after a step where every sequence produced a stop token.

        The reference runs each step through forward() and the sampler's argmax; the CPU fused
        decoder runs them all in one C++ call (worker/fused_decoder.py), with the same tokens, where the
        sequences all use one LoRA adapter or none."""
        stop_ids = [seq.stop_token_ids for seq in seqs]
        lora_id = one_lora_id([seq.lora_id for seq in seqs])
        if self._fused_decode_fits(len(seqs)) and lora_id is not None:
            last = [DecodeRow(seq.block_table, seq.num_tokens + num_steps - 1) for seq in seqs]
            steps = self.fused_decoder.greedy_steps(
                [seq.last_token_id for seq in seqs], [seq.num_tokens for seq in seqs],
                padded_block_tables(last, self.kv_cache.block_size), stop_ids, num_steps, self.kv_cache,
                self.lora.fused_decoder_weights(lora_id) if lora_id else None)
        else:
            steps = self.greedy_steps_reference(seqs, num_steps, stop_ids)
        return [SampledTokens(seq, list(tokens), [None] * len(tokens))
                for seq, tokens in zip(seqs, zip(*steps, strict=True), strict=True)]

    def greedy_steps_reference(self, seqs: list[Sequence], num_steps: int,
                               stop_ids: list[set[int]]) -> list[list[int]]:
        """greedy_steps one forward at a time: the tokens of each step run, [steps][len(seqs)]. A row whose
        logits leave nothing to pick gets BROKEN_ROW, which ends it (its later steps feed token 0, dropped)."""
        steps: list[list[int]] = []
        input_ids = [seq.last_token_id for seq in seqs]
        for i in range(num_steps):
            step = StepInput(input_ids=input_ids, prefill=[], sample_rows=list(range(len(seqs))),
                             decode=[DecodeRow(seq.block_table, seq.num_tokens + i) for seq in seqs],
                             float32_logits=False,
                             lora_ids=[seq.lora_id for seq in seqs] if any(s.lora_id for s in seqs) else [])
            tokens = greedy_tokens(self.forward(step)).tolist()
            steps.append(tokens)
            if all(t in stop or t == BROKEN_ROW for t, stop in zip(tokens, stop_ids, strict=True)):
                break
            input_ids = [max(t, 0) for t in tokens]
        return steps

    @staticmethod
    def _sampling_inputs(seqs: list[Sequence]) -> tuple[list, ...]:
        """What sampler.sample and rejection_sample take per sequence: params, generators, prompt
        and output token ids, stop token ids."""
        return ([s.sampling_params for s in seqs], [s.generator for s in seqs],
                [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
                [s.stop_token_ids for s in seqs])

    @staticmethod
    def prepare(batch: ScheduledBatch) -> tuple[StepInput, list[Sequence], list[Sequence]]:
        """The step's tokens, flat (decode tokens first, then the prompt chunks), the sequence
        sampled from each of the first step.sample_rows (a prompt's row once more for each sibling
        waiting to fork from it), and the sequences whose drafts the rest of the sample rows
        verify (all of their rows).

        A sequence's newest token and its drafts are decode rows, one per token, each attending to
        the cache up to itself (its keys are stored before attention runs): each row is computed
        exactly as a decode step at that position would compute it, through the same kernels.

        step.lora_ids gets each row's LoRA adapter (Sequence.lora_id) when some sequence has one: such a step runs
        the model's per-module forward (CUDA graphs compute the base model only), or the fused CPU decoder for a
        decode step whose rows all use one adapter (one_lora_id)."""
        step = StepInput(input_ids=[], decode=[], prefill=[], sample_rows=[])
        with_lora = any(seq.lora_id for seq in batch.seqs)
        seqs: list[Sequence] = []
        verify_rows: list[tuple[Sequence, range]] = []

        def sample_from(row: int, seq: Sequence) -> None:
            for s in [seq, *seq.forks]:
                seqs.append(s)
                step.sample_rows.append(row)

        for seq in batch.decode + [s.seq for s in batch.spec_decode]:
            first = len(step.input_ids)
            tokens = [seq.last_token_id, *seq.spec_token_ids]  # (no drafts: a plain decode row)
            step.input_ids += tokens
            if with_lora:
                step.lora_ids += [seq.lora_id] * len(tokens)
            step.decode += [DecodeRow(seq.block_table, seq.num_tokens + j)
                            for j in range(len(tokens))]
            if seq.spec_token_ids:
                verify_rows.append((seq, range(first, first + len(tokens))))
            else:
                sample_from(first, seq)
        for seq, n in batch.prefill:
            start = seq.num_computed_tokens
            if seq.needs_prompt_logprobs:
                ModelRunner._prompt_logprob_rows(step, seq, start, n)
            step.input_ids += seq.token_ids(start, start + n)
            if with_lora:
                step.lora_ids += [seq.lora_id] * n
            step.prefill.append(PrefillRow(seq.block_table, start, n))
            if start + n == seq.num_tokens:
                sample_from(len(step.input_ids) - 1, seq)
        for _, rows in verify_rows:  # their logits come after every other row's
            step.sample_rows += rows
        step.float32_logits = bool(verify_rows) or not all(seq.samples_by_argmax for seq in seqs)
        return step, seqs, [seq for seq, _ in verify_rows]

    @staticmethod
    def _prompt_logprob_rows(step: StepInput, seq: Sequence, start: int, n: int) -> None:
        """The rows of seq's chunk [start, start + n) (added to step next) whose logits give prompt logprobs
        still missing: position p predicts prompt token p + 1, so the prompt's last position gives none (it
        samples), and a chunk's last position predicts the next chunk's first token. Positions whose entries
        seq already has (computed before a preemption) are not read again."""
        first = max(start, len(seq.prompt_logprobs) - 1)
        end = min(start + n, len(seq.prompt_token_ids) - 1)
        if end > first:
            step.prompt_logprobs.append(PromptLogprobRows(
                seq.request_id, first + 1, len(step.input_ids) + first - start,
                seq.prompt_token_ids[first + 1: end + 1], seq.sampling_params.prompt_logprobs))

    def take_prompt_logprobs(self) -> list[PromptLogprobs]:
        """The prompt logprobs computed since the last call (the engine adds them to their requests)."""
        taken, self.prompt_logprobs = self.prompt_logprobs, []
        return taken

    def forward(self, step: StepInput) -> torch.Tensor | None:
        """Logits [len(step.sample_rows), V], float32 unless step.float32_logits is False (None when
        nothing is sampled; the pooler's rows with a pooler): a CUDA graph's replay for a decode-only
        step that has one, else the eager forward (with the other ranks, under tensor parallelism)."""
        if (not step.prefill and self.graph_runner is not None and not step.lora_ids
                and self.graph_runner.can_run(step.decode)):
            logits = self.graph_runner.run(step.input_ids, step.decode)  # [b, V], padded inside
            if step.sample_rows != list(range(len(step.decode))):
                logits = logits[torch.tensor(step.sample_rows, device=self.device)]
            return logits
        if self.model.tp_size > 1:
            step.block_copies, self._block_copies = self._block_copies, []
            if self.lora is not None:  # every rank runs each row's adapter from the same slot
                step.lora_sync = self.lora.sync_for_workers(step.lora_ids)
            distributed.broadcast_object(step)  # the workers run the same forward on their shards
        return self.run_model(step)

    @torch.inference_mode()
    def run_model(self, step: StepInput) -> torch.Tensor | None:
        """This rank's forward of one step: forward()'s logits on rank 0, None elsewhere."""
        for src, dst in step.block_copies:
            self.kv_cache.copy_block(src, dst)
        meta = AttentionMetadata.build(step.decode, step.prefill, self.kv_cache.block_size,
                                       self.device, paged_backend=self.attention_backend)
        input_ids = torch.tensor(step.input_ids, device=self.device)
        lora_id = one_lora_id(step.lora_ids)
        if (not step.prefill and meta.paged_decode is not None and self._fused_decode_fits(len(step.decode))
                and lora_id is not None):  # (the rows' one adapter, or none)
            lora = self.lora.fused_decoder_weights(lora_id) if lora_id else None
            logits = self.fused_decoder(input_ids, self.kv_cache, meta, lora)  # [N, V]: every row's
            rows = step.sample_rows  # (each row once, in order, unless drafts or forks say otherwise)
            return logits if rows == list(range(len(logits))) else logits[torch.tensor(rows)]
        if step.lora_ids:  # the model's projections add each row's adapter (nanoqwen/lora/layers.py)
            self.lora.prepare(step.lora_ids)
        try:
            hidden = self.model(input_ids, meta.positions, self.kv_cache, meta)
        finally:
            if step.lora_ids:
                self.lora.clear()
        if step.prompt_logprobs:
            self._compute_prompt_logprobs(hidden, step.prompt_logprobs)
        if not step.sample_rows:
            return None
        hidden = hidden[torch.tensor(step.sample_rows, device=self.device)]  # [M, H]
        if self.pooler is not None:
            return self.pooler(hidden)
        return self.model.compute_logits(hidden, torch.float32 if step.float32_logits else None)

    def _compute_prompt_logprobs(self, hidden: torch.Tensor, chunks: list[PromptLogprobRows]) -> None:
        """The prompt logprobs of a step's chunks that ask for them, from their rows of hidden [N, H] through
        the LM head PROMPT_LOGPROBS_ROWS at a time (on every rank: under tensor parallelism each computes its
        slice of the vocabulary and rank 0 gathers them), added to self.prompt_logprobs on rank 0."""
        rows = [c.first_row + i for c in chunks for i in range(len(c.target_ids))]
        targets = [t for c in chunks for t in c.target_ids]
        counts = [c.num_logprobs for c in chunks for _ in c.target_ids]
        out: list[TokenLogprobs] = []
        for s in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            part = slice(s, s + PROMPT_LOGPROBS_ROWS)
            logits = self.model.compute_logits(hidden[torch.tensor(rows[part], device=self.device)])
            if logits is not None:  # (None on ranks > 0)
                out += compute_prompt_logprobs(logits, targets[part], counts[part])
        if self.model.tp_rank != 0:
            return
        first = 0
        for c in chunks:
            self.prompt_logprobs.append(PromptLogprobs(c.request_id, c.first_token,
                                                       out[first: first + len(c.target_ids)]))
            first += len(c.target_ids)

    def _fused_decode_fits(self, num_rows: int) -> bool:
        """Whether a decode step of num_rows rows runs through the fused CPU decoder (up to the gemv kernels' rows)."""
        return self.fused_decoder is not None and num_rows <= self.model.kernels.matmul.gemv_max_rows


def one_lora_id(lora_ids: list[int]) -> int | None:
    """The LoRA adapter of every row of a step (StepInput.lora_ids, or each sequence's lora_id): 0 when none has one
    (an empty list, or all 0), the adapter's lora_id when they all use it, None when they differ (some rows with
    another adapter or none): the fused CPU decoder computes one adapter for all rows, or the base model."""
    if not any(lora_ids):
        return 0
    first = lora_ids[0]
    return first if first and all(i == first for i in lora_ids) else None
