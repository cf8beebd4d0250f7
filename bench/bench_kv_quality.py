"""The error a quantised KV cache adds to next-token distributions, nanoqwen's cache types beside llama.cpp's, on
the same weights and token ids: the mean KL divergence and the top-1 agreement against each engine's own 16-bit
cache along a long continuation.

    python bench/bench_kv_quality.py                      # a 1,024-token prompt, then 256 decode steps
    python bench/bench_kv_quality.py --prompt-len 4096 --write

The checkpoint: random, with the exact Qwen3-0.6B shape and weights of std 0.08 (at init scale, 0.02, next-token
distributions are nearly flat and rounding flips near-ties; larger weights make them peaked, as a trained model's
are), written once to bench/.models/ and converted to a bf16 GGUF with llama.cpp's own converter (bench_llamacpp.py's
docstring). The tokens: random ids (seed 0), a prompt of --prompt-len, then --steps more fed one at a time
(teacher-forced) as decode steps, each reading every earlier position from the cache; the full next-token
distribution (float32 log-softmax of the logits) at the prompt's last position and after each step.

- nanoqwen: the bf16 checkpoint with kv_cache_dtype auto (bf16, its reference), int8, fp8_e4m3, fp8_e5m2; the
  prompt in one step, each further token a decode step through the decode path the engine picks for that cache.
- llama.cpp (llama-cpp-python, flash attention on): the bf16 GGUF with an f16 cache (its reference), q8_0 and q4_0;
  the prompt in one `eval` (batch 512), each further token one `eval`.

Each row: mean KL(reference || cache type) over the positions, and the share of positions whose most likely next
token is the reference's. The two references are also compared with each other: how far apart the engines are
before any cache quantisation (bf16 weights both; nanoqwen rounds activations to bf16 where the model does).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (its machine line and BENCHMARKS.md writer)
import llamacpp_peer  # noqa: E402  (its GGUF conversion)

STD = 0.08
MODEL_DIR = bench_model.ROOT / "bench" / ".models" / f"qwen3-0.6b-random-bf16-std{STD}"
NANOQWEN_CACHES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
LLAMA_CACHES = ("f16", "q8_0", "q4_0")
# bytes a cached value takes (llama.cpp's q8_0: 32 values in 34 bytes; q4_0: in 18; nanoqwen's 8-bit types: a
# float32 scale per token and kv head of 128 values)
VALUE_BYTES = {"auto": 2.0, "int8": 1 + 4 / 128, "fp8_e4m3": 1 + 4 / 128, "fp8_e5m2": 1 + 4 / 128,
               "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def token_ids(count: int) -> list[int]:
    """Random ids of ordinary tokens (below Qwen3's special ones), seed 0."""
    return np.random.default_rng(0).integers(1000, 150000, count).tolist()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return (z - np.log(np.exp(z).sum(-1, keepdims=True))).astype(np.float32)


def nanoqwen_logprobs(tokens: list[int], prompt_len: int, cache_dtype: str) -> np.ndarray:
    """Log-probabilities [len(tokens) - prompt_len, V] along tokens: the prompt as one step, then decode steps."""
    from nanoqwen import LLM
    from nanoqwen.worker.teacher_forcing import continuation_logprobs

    model = LLM(str(MODEL_DIR), dtype="bfloat16", device="cpu", max_model_len=len(tokens) + 16,
                kv_cache_memory=(len(tokens) + 64) * (128 << 10)).llm_engine.model  # (the engine's own cache: unused)
    return continuation_logprobs(model, tokens, prompt_len, cache_dtype).numpy()


def llama_logprobs(gguf: Path, tokens: list[int], prompt_len: int, cache: str) -> np.ndarray:
    """As nanoqwen_logprobs, for llama.cpp on the GGUF file with a cache of `cache` type."""
    import llama_cpp

    ggml_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
                 "q4_0": llama_cpp.GGML_TYPE_Q4_0}[cache]
    threads = os.cpu_count() or 1
    llm = llama_cpp.Llama(str(gguf), n_ctx=len(tokens) + 64, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, flash_attn=True, type_k=ggml_type, type_v=ggml_type, verbose=False)
    vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:  # the last evaluated token's (the only one a batch asks logits for)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).copy()

    llm.eval(tokens[:prompt_len])
    rows = [last_logits()]
    for n in range(prompt_len + 1, len(tokens)):
        llm.eval(tokens[n - 1: n])
        rows.append(last_logits())
    return log_softmax(np.stack(rows))


def kl_and_top1(reference: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """Mean KL(reference || other) over the positions, and the share whose most likely token agrees."""
    vocab = min(reference.shape[1], other.shape[1])  # (a GGUF's vocabulary may be padded differently)
    ref, oth = reference[:, :vocab].astype(np.float64), other[:, :vocab].astype(np.float64)
    kl = (np.exp(ref) * (ref - oth)).sum(-1)
    return float(kl.mean()), float((ref.argmax(-1) == oth.argmax(-1)).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=256, help="decode steps after the prompt")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    args = parser.parse_args()
    start = time.perf_counter()
    if not (MODEL_DIR / "config.json").exists():
        from nanoqwen.model_loader.init_random import write_random_model

        print(f"writing a random Qwen3-0.6B-shaped checkpoint (std {STD}) to {MODEL_DIR} ...", file=sys.stderr)
        write_random_model(MODEL_DIR, "qwen3-0.6b", dtype="bfloat16", std=STD)
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
        print("llama-cpp-python is not installed: nanoqwen's rows only (bench_llamacpp.py's docstring builds it)",
              file=sys.stderr)
    tokens = token_ids(args.prompt_len + args.steps)
    logprobs = {}
    for cache in NANOQWEN_CACHES:
        print(f"nanoqwen, cache {cache} ...", file=sys.stderr, flush=True)
        logprobs[("nanoqwen", cache)] = nanoqwen_logprobs(tokens, args.prompt_len, cache)
    if llama_cpp is not None:
        gguf = llamacpp_peer.gguf_files(MODEL_DIR, ("bf16",))["bf16"]
        for cache in LLAMA_CACHES:
            print(f"llama.cpp, cache {cache} ...", file=sys.stderr, flush=True)
            logprobs[("llama.cpp", cache)] = llama_logprobs(gguf, tokens, args.prompt_len, cache)
    references = {"nanoqwen": "auto", "llama.cpp": "f16"}
    lines = ["| system | KV cache | bytes a cached value | mean KL vs its 16-bit cache | top-1 agreement |",
             "|---|---|---:|---:|---:|"]
    for (system, cache), lp in logprobs.items():
        kl, top1 = kl_and_top1(logprobs[(system, references[system])], lp)
        name = "bf16 (auto)" if cache == "auto" else cache
        lines.append(f"| {system} | {name} | {VALUE_BYTES[cache]:.3f} | {kl:.2e} | {top1:.1%} |")
    body = (f"### What a quantised KV cache costs: next-token distributions, nanoqwen vs llama.cpp, CPU\n\n"
            f"`{bench_model.command_line('bench_kv_quality.py', sys.argv[1:])}`: a random checkpoint with the exact "
            f"Qwen3-0.6B shape and weights of std {STD}, bf16 weights in both engines (llama.cpp: its converter's "
            f"bf16 GGUF, flash attention on); random token ids, a {args.prompt_len:,}-token prompt and "
            f"{args.steps} teacher-forced decode steps, each reading every earlier position from the cache; KL and "
            f"top-1 over the {args.steps} next-token distributions (the script's docstring).\n\n"
            f"{bench_model.machine_line('cpu')}\n\n" + "\n".join(lines))
    if ("llama.cpp", "f16") in logprobs:
        kl, top1 = kl_and_top1(logprobs[("nanoqwen", "auto")], logprobs[("llama.cpp", "f16")])
        body += (f"\n\nThe two references against each other (nanoqwen's bf16 cache vs llama.cpp's f16 cache, the same "
                 f"weights): mean KL {kl:.2e}, top-1 agreement {top1:.1%}.")
    print(body)
    print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    if args.write:
        bench_model.write_benchmarks(bench_model.section_name("bench_kv_quality", "cpu"), body)


if __name__ == "__main__":
    main()
