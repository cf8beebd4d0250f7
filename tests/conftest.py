"""Shared test helpers: random-weight checkpoints of small Qwen3 shapes, and running
nanoqwen's model directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never try the network in tests
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from nanoqwen import LLM  # noqa: E402
from nanoqwen.attention.kv_cache import KVCache  # noqa: E402
from nanoqwen.attention.metadata import AttentionMetadata, PrefillRow  # noqa: E402
from nanoqwen.layers.linear import Linear  # noqa: E402
from nanoqwen.model_loader.init_random import preset_config, write_random_model  # noqa: E402

# Small shapes covering what the math must get right (names are used as test ids).
SHAPES = {
    # head_dim 32 != hidden/heads = 16, GQA ratio 1, tied head
    "gqa1-tied-headdim": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                              head_dim=32, intermediate_size=96, tie_word_embeddings=True),
    # GQA ratio 2, untied head, head_dim == hidden/heads
    "gqa2-untied": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, tie_word_embeddings=False),
    # GQA ratio 4, untied, weights sharded over several files
    "gqa4-sharded": dict(hidden_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                         intermediate_size=160, tie_word_embeddings=False, num_hidden_layers=3),
}


# Token-id prompts of different lengths (5, 13, 1 and 20 tokens) for engine tests.
PROMPTS = [
    [9707, 11, 847, 829, 374],
    [785, 6722, 315, 9625, 374, 264, 1293, 11652, 9934, 13, 576, 1156, 374],
    [40],
    [3838, 374, 279, 7290, 315, 2272, 30, 358, 1744, 432, 374, 220, 19, 17, 13, 2055, 1128, 30,
     1084, 220],
]

# A chat template's system turn (14 tokens): prompts starting with it share their first blocks.
SYSTEM = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198]

# Crafted model output for the chat parsers and the server: a reasoning block, then two tool calls.
THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


# Same thread count as this process, so the subprocess computes bit for bit what the in-process
# LLM does.
ENV = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": str(torch.get_num_threads()),
       "HF_HUB_OFFLINE": "1"}


def run_cli(*args: str, stdin: str = "") -> SimpleNamespace:
    """Run `python -m nanoqwen ARGS`; stdout/stderr decoded as UTF-8 without newline
    translation."""
    r = subprocess.run([sys.executable, "-m", "nanoqwen", *args], input=stdin.encode(),
                       capture_output=True, env=ENV, timeout=120)
    return SimpleNamespace(returncode=r.returncode, stdout=r.stdout.decode("utf-8"),
                           stderr=r.stderr.decode("utf-8", errors="replace"))


# tests/<folder>/ -> the marker its tests carry (pyproject.toml lists the markers)
FOLDER_MARKERS = {"server": pytest.mark.server, "distributed": pytest.mark.tensor_parallel}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for folder, marker in FOLDER_MARKERS.items():
            if folder in item.path.relative_to(Path(__file__).parent).parts[:-1]:
                item.add_marker(marker)


def tiny_config(**overrides) -> dict:
    raw = preset_config("tiny")
    raw.update(overrides)
    return raw


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built() -> None:
    """Build nanoqwen's C++ CPU kernels once, here, before any test: the CLI and server tests run
    nanoqwen in subprocesses under a timeout, and a first build inside one of them (a minute or two on
    2 cores) would spend that timeout. Built here, the subprocesses load the cached build."""
    from nanoqwen.ops.cpu import kernels as cpu_kernels

    cpu_kernels.available()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name, dtype=..., std=..., shard_bytes=...) -> folder, written once per session."""
    cache: dict[tuple, Path] = {}

    def make(name: str, dtype: str = "float32", std: float = 0.08, max_shard_bytes: int = 2 << 30,
             **overrides) -> Path:
        key = (name, dtype, std, max_shard_bytes, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            raw = tiny_config(**SHAPES.get(name, {}), **overrides)
            out = tmp_path_factory.mktemp(name)
            cache[key] = write_random_model(out, raw, dtype=dtype, std=std,
                                            max_shard_bytes=max_shard_bytes)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_dir(checkpoint) -> Path:
    return checkpoint("tiny", dtype="float32")


def make_llm(path, **kwargs) -> LLM:
    """A float32 CPU engine with a small KV cache of 4-token blocks (block tables, prefix sharing
    and preemption show up on short prompts); keyword arguments override the defaults."""
    kwargs = {"max_model_len": 128, "kv_cache_memory": 8 << 20, "block_size": 4, **kwargs}
    return LLM(path, dtype="float32", device="cpu", **kwargs)


def prompt_logits(model, token_ids: list[int]) -> torch.Tensor:
    """nanoqwen's float32 logits [T, V] for every position of one prompt (one prefill, fresh
    cache)."""
    cache, table = fresh_cache(model, len(token_ids))
    meta = AttentionMetadata.build([], [PrefillRow(table, 0, len(token_ids))], cache.block_size,
                                   model.device)
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), meta.positions, cache, meta)
        return model.compute_logits(hidden)


def fresh_cache(model, num_tokens: int, block_size: int = 4, num_seqs: int = 1,
                scatter: bool = False):
    """A KV cache with room for num_seqs sequences of num_tokens, and a block table per sequence.

    scatter=True interleaves the sequences' blocks (not consecutive), so attention has to gather
    them.
    """
    c = model.config
    per_seq = -(-num_tokens // block_size)
    cache = KVCache(c.num_hidden_layers, per_seq * num_seqs, block_size, c.num_key_value_heads,
                    c.head_dim, model.dtype, model.device)
    if scatter:
        tables = [list(range(i, per_seq * num_seqs, num_seqs)) for i in range(num_seqs)]
    else:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
    return cache, tables[0] if num_seqs == 1 else tables


def hf_model(path, dtype):
    """transformers' model of a checkpoint folder (Qwen3ForCausalLM or Qwen3MoeForCausalLM), sdpa
    attention."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                             attn_implementation="sdpa").eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate, with EOS disabled so exactly n tokens come out."""
    import transformers

    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0,
                                           eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def our_greedy(llm, prompt: list[int], n: int) -> list[int]:
    from nanoqwen import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].token_ids


@pytest.fixture
def triton_kernel(monkeypatch):
    """paged_decode_attention_triton on CPU tensors (TRITON_INTERPRET=1), with the interpreter's
    bf16 tl.dot fixed."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from nanoqwen.attention.backends import triton_paged as tpa

    if not isinstance(tpa._paged_decode_kernel, interpreter.InterpretedFunction):
        pytest.skip("the kernel module was imported before TRITON_INTERPRET=1 was set "
                    "(run this file alone)")
    # triton 3.9's interpreter multiplies bf16 operands of tl.dot as their raw uint16 bits: widen
    # them to float32 first (exact), as the GPU's bf16 MMA does.
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        def widen(h):
            if h.dtype == tl.bfloat16:
                widened = (h.data.astype(np.uint32) << 16).view(np.float32)
                return interpreter.TensorHandle(widened, tl.float32)
            return h
        return original(self, widen(a), widen(b), d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    return tpa.paged_decode_attention_triton


def shuffled_decode_rows(block_size: int, num_blocks: int, generator: torch.Generator) -> list:
    """Five decode rows, one at each block-boundary case (1, block_size, 3 blocks + 1, 5 blocks - 1, 2 tokens), on
    shuffled (non-consecutive) blocks of a pool of num_blocks."""
    from nanoqwen.attention.metadata import DecodeRow

    lens = [1, block_size, 3 * block_size + 1, 5 * block_size - 1, 2]
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    decode, used = [], 0
    for n in lens:
        nb = -(-n // block_size)
        decode.append(DecodeRow(perm[used: used + nb], n))
        used += nb
    return decode


def matrix_of(module: torch.nn.Module, in_features: int, expert: tuple[str, int] | None = None) -> torch.Tensor:
    """The float32 matrix [out, in] a (quantised, possibly stacked) linear, a row-parallel one's part of the sum, or
    an expert computes with: its product with the identity (each output one weight times 1.0: exact)."""
    eye = torch.eye(in_features)
    with torch.no_grad():
        if expert is not None:
            return module.expert_linear(eye, *expert).T
        return (module.matmul(eye, None) if isinstance(module, Linear) else module(eye)).T


def rank_rows(w: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    """Rank `rank` of 2's rows of a column-parallel matrix stacked from parts of these sizes: half of each part."""
    return torch.cat([p.chunk(2)[rank] for p in w.split(sizes)])


@pytest.fixture(scope="module")
def one_thread_per_rank():
    """Two ranks on two cores: one thread each, for the TP=1 reference too (the tensor-parallel tests use it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
