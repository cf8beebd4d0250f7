"""LLM: the offline Python API, shaped like vLLM's (`LLM(model).generate(prompts, params)`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nanoqwen.config import EngineConfig
from nanoqwen.engine.llm_engine import LLMEngine
from nanoqwen.errors import InvalidRequestError
from nanoqwen.hub import DEFAULT_MODEL
from nanoqwen.outputs import RequestOutput
from nanoqwen.sampling_params import SamplingParams
from nanoqwen.tokenizer import Tokenizer

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Load a Qwen3 checkpoint (folder or hub id) and generate for many prompts at once."""

    def __init__(self, model: str | Path = DEFAULT_MODEL, **options: Any) -> None:
        """options: the engine options, EngineConfig's fields (nanoqwen/config.py): dtype, device,
        max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_memory, block_size,
        enable_prefix_caching, seed, enforce_eager, tensor_parallel_size, quantization.

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

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for strings (tokenized as is, no chat template) or token-id lists; outputs keep
        input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(f"got {len(params)} sampling_params "
                                          f"for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             enable_thinking: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Render one conversation (or a list of them) with the model's chat template and
        generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = [tokenizer.apply_chat_template(conv, tools=tools, add_generation_prompt=True,
                                                 tokenize=True, enable_thinking=enable_thinking,
                                                 **(chat_template_kwargs or {}))
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts: list[Prompt], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [f"llm-{next(self._request_counter)}" for _ in prompts]
        # Tokenize and validate everything before queueing anything: a bad prompt leaves the engine
        # untouched.
        token_ids = [engine.tokenize(prompt) for prompt in prompts]
        for request_id, prompt, tokens, p in zip(ids, prompts, token_ids, params, strict=True):
            engine.add_request(request_id, prompt, p, prompt_token_ids=tokens)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="Generating", unit="req",
                   disable=not use_tqdm or len(prompts) < 8, dynamic_ncols=True)
        start, prompt_tokens, output_tokens = time.perf_counter(), 0, 0
        with bar:
            try:
                while len(finished) < len(prompts):
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            prompt_tokens += len(out.prompt_token_ids)
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

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[tuple[str, RequestOutput]]:
        """Generate for one prompt, yielding (new text, output so far) as tokens arrive.

        Text is yielded only once its UTF-8 is complete. Closing the iterator early (break, Ctrl-C)
        aborts the request and frees its KV-cache blocks.
        """
        engine = self.llm_engine
        request_id = f"llm-{next(self._request_counter)}"
        engine.add_request(request_id, prompt, sampling_params)
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
