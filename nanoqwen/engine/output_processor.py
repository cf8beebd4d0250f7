"""From sampled tokens to what the user sees: text, stop conditions, logprobs, RequestOutput.

Text is detokenized incrementally per answer. Stop strings are searched in the newly added
text; until an answer finishes, its last (longest stop string - 1) characters are held back, so
a stream never shows text that later turns out to start a stop string. A token's cost does not
grow with the request's stop lists beyond their bounded sizes: stop ids are a set made once per
request (Sequence.stop_token_ids), and each stop string is searched only in the new text and the
tail before it that could start it.

Prompt logprobs (SamplingParams.prompt_logprobs) arrive chunk by chunk as the prompt is prefilled
(worker/model_runner.py: PromptLogprobs); each extends the first sequence's list where it ends, so a chunk
computed twice (a step run again request by request) adds nothing twice. The list is complete before the
request's first token, and RequestOutput.prompt_logprobs carries it (the same list, never changed again).

A sampled token of BROKEN_ROW means the model gave that sequence no token to pick (its logits were NaN
or all -inf, nanoqwen/sample/sampler.py): the answer ends there with finish_reason "error".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from nanoqwen.core.sequence import Sequence
from nanoqwen.layers.pooler import EmbeddingPooler, ScorePooler
from nanoqwen.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    Logprob,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    ScoringOutput,
)
from nanoqwen.pooling_params import PoolingParams
from nanoqwen.sample.sampler import BROKEN_ROW, TokenLogprobs
from nanoqwen.sampling_params import SamplingParams
from nanoqwen.tokenizer import Tokenizer
from nanoqwen.worker.model_runner import PromptLogprobs


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    seqs: list[Sequence]
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    @property
    def error(self) -> str | None:
        """Why the request ended with an error (the first answer's that did), or None."""
        return next((s.error for s in self.seqs if s.error is not None), None)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> str | None:
        """Add a sampled token to seq; return the finish reason if this token ends it."""
        p = seq.sampling_params
        now = time.perf_counter()
        seq.first_token_time = seq.first_token_time or now
        seq.last_token_time = now
        if token == BROKEN_ROW:
            seq.error = ("the model's logits for this answer were NaN or all -inf, so there was no token to pick "
                         "(a broken checkpoint, or weights that overflow in this dtype)")
            return self._finish(seq, "error")
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.logprobs = seq.logprobs if seq.logprobs is not None else []
            seq.logprobs.append(self._logprob_dict(logprobs))
        old_len = len(seq.text)
        seq.text += seq.detokenizer.push(token)
        if token in seq.stop_token_ids:
            # None: the model's EOS, as in vLLM
            seq.stop_reason = token if token in (p.stop_token_ids or ()) else None
            return self._finish(seq, "stop")
        if seq.grammar is not None:
            seq.grammar.accept(token)
            if seq.grammar.is_finished:  # complete, and nothing more is allowed
                return self._finish(seq, "stop")
        if p.stop and len(seq.output_token_ids) >= p.min_tokens:
            hit = self._find_stop(seq.text, p, max(0, old_len - p.max_stop_len + 1))
            if hit is not None:
                index, stop = hit
                seq.text = seq.text[: index + (len(stop) if p.include_stop_str_in_output else 0)]
                seq.stop_reason = stop
                seq.finish_reason = "stop"
                return "stop"
        if (p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens) \
                or seq.num_tokens >= self.max_model_len:
            return self._finish(seq, "length")
        return None

    @staticmethod
    def _find_stop(text: str, p: SamplingParams, start: int) -> tuple[int, str] | None:
        hits = [(i, s) for s in p.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    @staticmethod
    def _finish(seq: Sequence, reason: str) -> str:
        seq.text += seq.detokenizer.flush()
        seq.finish_reason = reason
        return reason

    def add_prompt_logprobs(self, seq: Sequence, computed: PromptLogprobs) -> None:
        """Add a chunk's prompt logprobs to seq's (the request's first sequence), unless it holds them
        already."""
        if seq.prompt_logprobs is None or computed.first_token != len(seq.prompt_logprobs):
            return
        seq.prompt_logprobs += [self._logprob_dict(lp) for lp in computed.logprobs]

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        out = {lp.token_id: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([lp.token_id]))}
        for rank, (token_id, logprob) in enumerate(lp.top, start=1):
            out.setdefault(token_id, Logprob(logprob, rank, self.tokenizer.decode([token_id])))
        return out

    @staticmethod
    def pooled(seq: Sequence, data: torch.Tensor) -> None:
        """An embedding or scoring sequence got its result: it is finished."""
        seq.pooled = data
        seq.first_token_time = seq.last_token_time = time.perf_counter()
        seq.finish_reason = "stop"

    @staticmethod
    def make_pooling_output(state: RequestState, task: str) -> PoolingRequestOutput:
        """The embedding (cut to the request's dimensions, normalised) or the score."""
        seq, params = state.seqs[0], state.params
        if task == "embed":
            result = EmbeddingOutput(EmbeddingPooler.finish(seq.pooled, params))
        else:
            result = ScoringOutput(ScorePooler.finish(seq.pooled, params))
        m = state.metrics
        m.first_token_time = m.last_token_time = m.finished_time = seq.last_token_time
        return PoolingRequestOutput(state.request_id, state.prompt, state.prompt_token_ids, result,
                                    True, seq.num_cached_tokens, m)

    @staticmethod
    def make_output(state: RequestState) -> RequestOutput:
        completions = []
        for seq in state.seqs:
            text = seq.text
            hold = seq.sampling_params.max_stop_len - 1
            if seq.finish_reason is None and hold > 0:
                text = text[: max(0, len(text) - hold)]
            logprobs = list(seq.logprobs) if seq.logprobs else None
            completions.append(CompletionOutput(seq.index, text, list(seq.output_token_ids),
                                                seq.finish_reason, seq.stop_reason, logprobs))
        m = state.metrics
        firsts = [s.first_token_time for s in state.seqs if s.first_token_time is not None]
        lasts = [s.last_token_time for s in state.seqs if s.last_token_time is not None]
        m.first_token_time = min(firsts) if firsts else None
        m.last_token_time = max(lasts) if lasts else None
        m.num_output_tokens = max((len(s.output_token_ids) for s in state.seqs), default=0)
        finished = state.finished
        if finished and m.finished_time is None:
            m.finished_time = time.perf_counter()
        first = state.seqs[0]
        prompt_logprobs = (first.prompt_logprobs if first.prompt_logprobs is not None
                           and not first.needs_prompt_logprobs else None)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished, first.num_cached_tokens, m, state.error, prompt_logprobs)

    @staticmethod
    def make_error_output(state: RequestState, error: str) -> RequestOutput | PoolingRequestOutput:
        """A request ended by an error of its own (every answer's finish_reason "error")."""
        for seq in state.seqs:
            if seq.finish_reason is None:
                seq.finish_reason, seq.error = "error", error
        m = state.metrics
        m.finished_time = time.perf_counter()
        if isinstance(state.params, PoolingParams):
            return PoolingRequestOutput(state.request_id, state.prompt, state.prompt_token_ids, None, True,
                                        state.seqs[0].num_cached_tokens, m, error)
        output = OutputProcessor.make_output(state)
        output.error = error
        return output
