"""LLM: the offline Python API, shaped like vLLM's (`LLM(model).generate(prompts, params)`; for
embedding and reranker models `LLM(model).embed(texts)` and `.score(query, documents)`)."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nanoqwen.config.engine import DEFAULT_MODEL, EngineConfig
from nanoqwen.engine.llm_engine import LLMEngine
from nanoqwen.errors import InvalidRequestError
from nanoqwen.lora.request import LoRARequest
from nanoqwen.outputs import EmbeddingRequestOutput, RequestOutput, ScoringRequestOutput
from nanoqwen.pooling_params import PoolingParams
from nanoqwen.sampling_params import SamplingParams
from nanoqwen.tokenizer import Tokenizer

Prompt = str | list[int]
# A prompt as vLLM's LLM takes it: a string, token ids, or one of its prompt dicts, TextPrompt
# {"prompt": text} or TokensPrompt {"prompt_token_ids": [ids]}.
PromptInput = Prompt | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """Load a Qwen3 checkpoint (folder or hub id) and generate for many prompts at once.

    Thread-safe: calls from several threads run one after another. A request that ends with an error of
    its own (RequestOutput.error, finish_reason "error") comes back with the others' outputs."""

    def __init__(self, model: str | Path = DEFAULT_MODEL, **options: Any) -> None:
        """options: the engine options, EngineConfig's fields (nanoqwen/config/model.py): dtype, device,
        max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_memory, block_size,
        enable_prefix_caching, seed, enforce_eager, tensor_parallel_size, quantization, task,
        speculative_config (speculative decoding: README, nanoqwen/config/model.py SpeculativeConfig),
        num_scheduler_steps (greedy decode steps run in one go), enable_lora, max_loras, max_lora_rank (LoRA
        adapters, chosen per call with lora_request=: docs/lora.md).

        task: "generate", "embed" (Qwen3-Embedding) or "score" (Qwen3-Reranker); by default read
        from the checkpoint (sentence-transformers' files mean "embed", the model card's
        pipeline_tag "text-ranking" means "score").

        tensor_parallel_size N > 1 splits the model over N processes (N GPUs, or CPU processes),
        started here or by torchrun; `llm.llm_engine.shutdown()` stops them (as does garbage
        collection or exit).
        """
        self._start(EngineConfig.from_kwargs(model, options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM from an EngineConfig (what the command line builds from its flags)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.llm_engine = LLMEngine(config)
        self._request_counter = itertools.count()
        # One call steps the engine at a time: calls from several threads run one after another (the engine
        # itself is not thread-safe). Reentrant, so a thread can nest calls as it could without the lock.
        self._lock = threading.RLock()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.input_processor.default_sampling_params()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for strings (tokenized as is, no chat template), token-id lists or vLLM's prompt
        dicts ({"prompt": text}, {"prompt_token_ids": ids}); outputs keep input order.

        lora_request: a LoRA adapter for every prompt, or a list of one per prompt (None: the base model); the
        engine needs enable_lora=True."""
        prompts = self._as_list(prompts)
        if not prompts:
            return []
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(f"got {len(params)} sampling_params "
                                          f"for {len(prompts)} prompts")
        token_ids = [self.llm_engine.input_processor.tokenize(prompt) for prompt in prompts]
        return self._run(prompts, token_ids, params, use_tqdm, "Generating",
                         _per_prompt(lora_request, len(prompts)))

    def embed(self, prompts: PromptInput | Sequence[PromptInput],
              pooling_params: PoolingParams | None = None, *, dimensions: int | None = None,
              prompt_name: str | None = None, prompt: str | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per text (or token-id list), in input order: `out.outputs.embedding`.

        dimensions: keep the first d values, renormalised. prompt_name: one of the checkpoint's
        prompts (config_sentence_transformers.json, e.g. "query"), put before each text as
        sentence-transformers' encode does; prompt: that text given directly.
        """
        engine = self.llm_engine
        prompts = self._as_list(prompts)
        engine.input_processor.require_task("embed")
        if pooling_params is None:
            pooling_params = PoolingParams(dimensions=dimensions)
        elif dimensions is not None:
            pooling_params = dataclasses.replace(pooling_params, dimensions=dimensions)
        token_ids = [engine.input_processor.embedding_input(p, prompt_name, prompt, pooling_params)
                     for p in prompts]
        return self._run(prompts, token_ids, [pooling_params] * len(prompts), use_tqdm,
                         "Embedding")

    def score(self, query: str, documents: str | Sequence[str], *,
              instruction: str | None = None,
              pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """The relevance of each document to the query, in [0, 1], in input order:
        `out.outputs.score` (a Qwen3-Reranker; instruction: the task, default web search)."""
        engine = self.llm_engine
        engine.input_processor.require_task("score")
        pooling_params = pooling_params or PoolingParams()
        documents = [documents] if isinstance(documents, str) else list(documents)
        for name, text in [("query", query), *(("documents", d) for d in documents)]:
            if not isinstance(text, str):
                raise InvalidRequestError(f"{name} must be strings, got {type(text).__name__}")
        token_ids = [engine.input_processor.score_input(query, d, instruction, pooling_params) for d in documents]
        return self._run([None] * len(documents), token_ids, [pooling_params] * len(documents),
                         use_tqdm, "Scoring")

    @staticmethod
    def _as_list(prompts: PromptInput | Sequence[PromptInput]) -> list[Prompt]:
        """One prompt or a sequence of them, each as a string or a list of token ids."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        return [_prompt_value(p) for p in prompts]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             enable_thinking: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Render one conversation (or a list of them) with the model's chat template and
        generate (lora_request: as generate's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = [tokenizer.apply_chat_template(conv, tools=tools, add_generation_prompt=True,
                                                 tokenize=True, enable_thinking=enable_thinking,
                                                 **(chat_template_kwargs or {}))
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, prompts: list[Prompt | None], token_ids: list[list[int]],
             params: list[SamplingParams] | list[PoolingParams], use_tqdm: bool,
             desc: str, lora_requests: list[LoRARequest | None] | None = None) -> list[Any]:
        """Queue every request (tokenized by the caller; a request the engine refuses takes the ones queued
        before it back out: a bad prompt or parameter leaves the engine untouched), step until all finish,
        return their outputs in order."""
        with self._lock:
            return self._run_locked(prompts, token_ids, params, use_tqdm, desc,
                                    lora_requests or [None] * len(prompts))

    def _run_locked(self, prompts: list[Prompt | None], token_ids: list[list[int]],
                    params: list[SamplingParams] | list[PoolingParams], use_tqdm: bool,
                    desc: str, lora_requests: list[LoRARequest | None]) -> list[Any]:
        engine = self.llm_engine
        ids = [f"llm-{next(self._request_counter)}" for _ in prompts]
        try:
            for request_id, prompt, tokens, p, lora in zip(ids, prompts, token_ids, params, lora_requests,
                                                           strict=True):
                if lora is None:
                    engine.add_request(request_id, prompt, p, prompt_token_ids=tokens)
                else:
                    engine.add_request(request_id, prompt, p, prompt_token_ids=tokens, lora_request=lora)
        except BaseException:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        finished: dict[str, Any] = {}
        bar = tqdm(total=len(prompts), desc=desc, unit="req",
                   disable=not use_tqdm or len(prompts) < 8, dynamic_ncols=True)
        start, prompt_tokens, output_tokens = time.perf_counter(), 0, 0
        with bar:
            try:
                while len(finished) < len(prompts):
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            prompt_tokens += len(out.prompt_token_ids)
                            if isinstance(out, RequestOutput):
                                output_tokens += sum(len(c.token_ids) for c in out.outputs)
                            elapsed = time.perf_counter() - start
                            rates = (f"in {prompt_tokens / elapsed:.0f} tok/s, "
                                     f"out {output_tokens / elapsed:.0f} tok/s")
                            bar.set_postfix_str(rates, refresh=False)
                            bar.update(1)
            finally:
                # on error or Ctrl-C, leave nothing half-run in the engine
                for request_id in ids:
                    if request_id not in finished:
                        engine.abort_request(request_id)
        return [finished[i] for i in ids]

    def stream(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
               lora_request: LoRARequest | None = None) -> Iterator[tuple[str, RequestOutput]]:
        """Generate for one prompt, yielding (new text, output so far) as tokens arrive (lora_request: the
        LoRA adapter it runs with).

        Text is yielded only once its UTF-8 is complete. Closing the iterator early (break, Ctrl-C)
        aborts the request and frees its KV-cache blocks. Other threads' calls wait until the stream is
        done or closed.
        """
        engine = self.llm_engine
        request_id = f"llm-{next(self._request_counter)}"
        with self._lock:
            engine.add_request(request_id, _prompt_value(prompt), sampling_params, lora_request=lora_request)
            printed = 0
            try:
                while True:
                    for out in engine.step():
                        if out.request_id != request_id:
                            continue
                        delta, printed = out.text[printed:], len(out.text)
                        yield delta, out
                        if out.finished:
                            return
            finally:
                engine.abort_request(request_id)


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                num_prompts: int) -> list[LoRARequest | None]:
    """vLLM's lora_request argument as one entry per prompt: one for all, or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    requests = list(lora_request)
    if len(requests) != num_prompts:
        raise InvalidRequestError(f"got {len(requests)} lora_request entries for {num_prompts} prompts",
                                  param="lora_request")
    return requests


def _prompt_value(prompt: PromptInput) -> Prompt:
    """A prompt as a string or a list of token ids; vLLM's prompt dicts are unwrapped, and anything
    else is an InvalidRequestError that names what was given."""
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unknown:
            raise InvalidRequestError(f"prompt dict key {unknown[0]!r} is not supported: give "
                                      '{"prompt": text} or {"prompt_token_ids": [ids]}')
        if "prompt_token_ids" in prompt:  # (before "prompt", as vLLM reads them)
            prompt = prompt["prompt_token_ids"]
            if not isinstance(prompt, (list, tuple)):
                raise InvalidRequestError("prompt_token_ids must be a list of token ids, got "
                                          f"{type(prompt).__name__}")
            return list(prompt)
        if "prompt" not in prompt:
            raise InvalidRequestError('a prompt dict needs "prompt" (text) or "prompt_token_ids"')
        prompt = prompt["prompt"]
    if isinstance(prompt, (str, list)):  # (the engine checks the ids: ints in the vocabulary)
        return prompt
    raise InvalidRequestError("a prompt is a string, a list of token ids or a dict with "
                              f'"prompt" or "prompt_token_ids", got {type(prompt).__name__}')
