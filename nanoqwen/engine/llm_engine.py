"""LLMEngine: requests in, tokens out, one `step()` at a time. No I/O, so any front end can drive it.

request -> Scheduler (which tokens run) -> ModelRunner (forward + sampling) -> outputs here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoqwen.config import GenerationConfig
from nanoqwen.engine.model_runner import ModelRunner
from nanoqwen.engine.scheduler import Scheduler
from nanoqwen.engine.sequence import Sequence
from nanoqwen.errors import ConfigError, InvalidRequestError
from nanoqwen.loader import load_config, load_model, resolve_model_path
from nanoqwen.outputs import CompletionOutput, RequestOutput
from nanoqwen.sampling_params import SamplingParams
from nanoqwen.tokenizer import IncrementalDetokenizer, Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device.type!r} is not supported; use cpu or cuda")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """The checkpoint's dtype on GPU; bfloat16 on CPU (fast there with AMX/AVX-512), unless asked."""
    if dtype is None:
        return DTYPES[checkpoint_dtype] if device.type == "cuda" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype == "auto":
        return resolve_dtype(None, checkpoint_dtype, device)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer


class LLMEngine:
    def __init__(self, model: str | Path, *, dtype: str | torch.dtype | None = None,
                 device: str | torch.device | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 2048, seed: int | None = 0) -> None:
        self.model_dir = resolve_model_path(str(model))
        self.config = load_config(self.model_dir)
        self.generation_config = GenerationConfig.from_file(
            self.model_dir / "generation_config.json", fallback_eos=self.config.eos_token_id)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.config.torch_dtype, self.device)
        limit = self.config.max_position_embeddings
        self.max_model_len = max_model_len or limit
        if not 1 < self.max_model_len <= limit:
            raise ConfigError(f"max_model_len={self.max_model_len} must be in [2, {limit}] "
                              f"(max_position_embeddings of {self.model_dir / 'config.json'})")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.eos_token_ids = set(self.generation_config.eos_token_id or self.config.eos_token_id)
        if not self.eos_token_ids and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = {self.tokenizer.eos_token_id}
        model_ = load_model(self.model_dir, self.config, self.dtype, self.device, self.max_model_len)
        self.runner = ModelRunner(model_, max_num_seqs, self.max_model_len)
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens)
        self.generator = torch.Generator(self.device).manual_seed(
            seed if seed is not None else random.randrange(2**63))
        self.requests: dict[str, _Request] = {}

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    def default_sampling_params(self) -> SamplingParams:
        """The checkpoint's recommended sampling (generation_config.json), as vLLM does."""
        g = self.generation_config
        return SamplingParams(
            temperature=(g.temperature if g.temperature is not None else 1.0) if g.do_sample else 0.0,
            top_k=g.top_k or -1, top_p=g.top_p if g.top_p is not None else 1.0, min_p=g.min_p or 0.0)

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None) -> None:
        """Queue a request; a string is tokenized as is (no chat template), a list is used as token ids."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        params = sampling_params or self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(token_ids)
        seq = Sequence(request_id, token_ids, params, prompt=text)
        if params.seed is not None:
            seq.generator = torch.Generator(self.device).manual_seed(params.seed)
        else:
            seq.generator = self.generator
        self.requests[request_id] = _Request(seq, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens))
        self.scheduler.add(seq)

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        vocab = self.config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]!r} is not in the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}: "
                "shorten the prompt or raise max_model_len (--max-model-len)")

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self._release(request.seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the requests that got a new token (finished ones last time they appear)."""
        batch = self.scheduler.schedule()
        if batch.empty:
            return []
        outputs = []
        for seq, token in self.runner.execute(batch):
            request = self.requests[seq.request_id]
            seq.output_token_ids.append(token)
            request.detokenizer.push(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                request.detokenizer.flush()
                self._release(seq)
                del self.requests[seq.request_id]
            outputs.append(self._output(request))
        return outputs

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.runner.kv_cache.release(seq.slot)
        self.scheduler.finish(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.sampling_params
        if (token in self.eos_token_ids and not p.ignore_eos) or (p.stop_token_ids and token in p.stop_token_ids):
            return "stop"
        if (p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens) \
                or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(request: _Request) -> RequestOutput:
        seq = request.seq
        completion = CompletionOutput(0, request.detokenizer.text, list(seq.output_token_ids), seq.finish_reason)
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion],
                             finished=seq.finish_reason is not None)
