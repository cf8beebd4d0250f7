"""The engine's options, defined and validated once: EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from nanoqwen.config.cache import check_kv_cache_dtype
from nanoqwen.config.model import Qwen3Config, check_tensor_parallel_size
from nanoqwen.config.quantization import check_quantization
from nanoqwen.config.speculative import SpeculativeConfig
from nanoqwen.errors import ConfigError

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"


@dataclass
class EngineConfig:
    """Every engine option, defined and validated here once: `LLM(model, **options)`, the command
    line (engine_args.py) and the server build one, and `LLMEngine` takes it.

    kv_cache_memory: bytes (int) or a fraction of the free memory (float), per rank; default 4 GiB
    on CPU (or half the available memory), 90% of what the weights leave free on GPU
    (worker/memory.py).
    kv_cache_dtype: how the KV cache stores keys and values: "auto" (the model's dtype), "int8", "fp8" /
    "fp8_e4m3" or "fp8_e5m2" (codes and a scale per token and kv head: about half the bytes, so twice the
    tokens in the same kv_cache_memory; nanoqwen/config/cache.py).
    enforce_eager: no torch.compile (CPU) and no CUDA graphs (GPU): faster start, slower steps.
    quantization: None (the checkpoint's weights), "int8" or "int4" (weight-only, made at load:
    nanoqwen/quantization/).
    tensor_parallel_size N > 1 splits the model over N processes (N GPUs, or CPU processes), started
    by the engine or by torchrun.
    task: "generate", "embed" or "score"; "auto" reads it from the checkpoint (nanoqwen/config/pooling.py).
    speculative_config: speculative decoding (SpeculativeConfig: a dict or JSON text is read into
    one).
    num_scheduler_steps: decode steps run in one go when every sequence of a decode batch is
    greedy without logprobs, penalties or grammar (vLLM's multi-step scheduling,
    core/scheduler.py): less Python per token, but tokens arrive k at a time and a new request
    waits up to k steps to start. 1 (the default) schedules every step.
    max_seqs_per_request_step: the most sequences of one request (its n answers) that decode in one step;
    its others wait their turn (fewest tokens first). A decode step, and so what other requests wait
    for, then grows with n only up to this many rows (a sampled row costs a few passes over the
    vocabulary); a request with a larger n runs its answers in turns, also when it is alone. (The
    step that finishes its prompt still samples every answer's first token.)
    max_stop_sequences, max_stop_token_ids: the most stop strings and stop token ids one request may
    give (each generated token is checked against them all); a request with more is refused.
    enable_lora, max_loras, max_lora_rank: LoRA adapters in PEFT's format (nanoqwen/lora/, docs/lora.md), as
    vLLM's: a request names its adapter (LoRARequest); up to max_loras adapters run in one step, each of rank
    at most max_lora_rank. With tensor parallelism each rank holds its shard of every adapter, cut as the base
    layer is. Not with speculative decoding or a pooling task.
    """

    model: str | Path = DEFAULT_MODEL
    # with a hub id for `model`: the GGUF file of that repo to load (as vLLM's and transformers' gguf_file)
    gguf_file: str | None = None
    # "bfloat16", "float16", "float32", a torch.dtype, or None/"auto"
    dtype: str | Any | None = None
    # "cpu", "cuda", a torch.device, or None (cuda when available)
    device: str | Any | None = None
    # default: the model's context, or what the KV cache holds if less
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | float | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    seed: int | None = 0  # None: a random seed for requests without their own
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    quantization: str | None = None
    # "auto" (from the checkpoint's files: nanoqwen/config/pooling.py), "generate", "embed" or "score"
    task: str = "auto"
    speculative_config: SpeculativeConfig | dict | str | None = None
    num_scheduler_steps: int = 1
    max_seqs_per_request_step: int = 8
    max_stop_sequences: int = 64
    max_stop_token_ids: int = 1024
    # LoRA adapters (nanoqwen/lora/, docs/lora.md), as vLLM's: requests may name an adapter (LoRARequest);
    # max_loras of them run in one step, each of rank at most max_lora_rank
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size", "num_scheduler_steps", "max_seqs_per_request_step",
                     "max_stop_sequences", "max_stop_token_ids", "max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
        m = self.kv_cache_memory
        if m is not None and not (isinstance(m, float) and 0 < m <= 1 or type(m) is int and m > 0):
            raise ConfigError(f"kv_cache_memory={m!r} must be a byte count (int > 0) "
                              "or a fraction of free memory (float in (0, 1])")
        check_quantization(self.quantization)
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype)
        tasks = ("auto", "generate", "embed", "score")
        if self.task not in tasks:
            raise ConfigError(f"task={self.task!r} is not a task; choose one of {', '.join(tasks)}")
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if self.enable_lora and self.speculative_config is not None:
            raise ConfigError("speculative decoding with LoRA adapters is not supported (the draft would need the "
                              "adapters too): drop speculative_config or enable_lora")
        if self.speculative_config is not None and self.num_scheduler_steps > 1:
            raise ConfigError(f"num_scheduler_steps={self.num_scheduler_steps} and speculative_config "
                              "both run several tokens a step: choose one (num_scheduler_steps=1 "
                              "with speculative decoding)")

    @classmethod
    def from_kwargs(cls, model: str | Path, options: dict[str, Any]) -> EngineConfig:
        """EngineConfig(model, **options), with an unknown option named (and the known ones
        listed)."""
        known = [f.name for f in fields(cls) if f.name != "model"]
        unknown = [name for name in options if name not in known]
        if unknown:
            raise ConfigError(f"unknown engine option {unknown[0]!r}; "
                              f"the options are: {', '.join(known)}")
        return cls(model, **options)

    def check_for_model(self, model: Qwen3Config, task: str, where: Path) -> None:
        """Whether these options fit the checkpoint (its config.json at `where`) and its task: the
        tensor-parallel size splits the model, max_model_len fits its context, and speculative decoding
        and tensor parallelism are asked of a model and task that have them."""
        check_tensor_parallel_size(model, self.tensor_parallel_size)
        self.check_model_len(model.max_position_embeddings, where)
        if task != "generate" and self.tensor_parallel_size > 1:
            raise ConfigError(f"task {task!r} runs on one device: set tensor_parallel_size=1 "
                              "(the Qwen3 embedding and reranker models fit one)")
        if self.enable_lora and task != "generate":
            raise ConfigError(f"LoRA adapters are for generation; task {task!r} does not run them: drop enable_lora")
        spec = self.speculative_config
        if spec is not None and task != "generate":
            raise ConfigError(f"speculative decoding speeds up generation; task {task!r} "
                              "generates nothing: drop speculative_config")
        if spec is not None and spec.method != "ngram" and self.tensor_parallel_size > 1:
            raise ConfigError(f"speculative method {spec.method!r} runs with "
                              "tensor_parallel_size=1 (its draft model is not split); use "
                              "'ngram', or one process")

    def check_model_len(self, limit: int, where: Path) -> None:
        """max_model_len against the model's max_position_embeddings (read from `where`)."""
        if self.max_model_len is not None and not 1 < self.max_model_len <= limit:
            raise ConfigError(f"max_model_len={self.max_model_len} must be in [2, {limit}] "
                              f"(max_position_embeddings of {where})")
