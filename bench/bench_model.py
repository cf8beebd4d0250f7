"""nanoqwen vs transformers on one machine, in one run: prefill, decode at batch 1 and 16, peak memory.
nanoqwen runs twice: with the checkpoint's bf16 weights and with `quantization="int8"` (weight-only int8).

    python bench/bench_model.py                 # random checkpoint with the exact Qwen3-0.6B shape
    python bench/bench_model.py --write         # also record the table in BENCHMARKS.md
    python bench/bench_model.py --model DIR     # any Qwen3 folder

Each system runs in its own subprocess (so its peak memory is its own) on the same checkpoint,
the same token ids and the same procedure: a generate call with 1 new token gives the prefill
time; one with 1 + N new tokens (EOS ignored) gives the decode rate as N / (difference).
The machine's ceilings (memory bandwidth from a large copy, bf16 matmul FLOP/s) are measured
in the same run so each figure can be read as a fraction of what the hardware allows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / "bench" / ".models" / "qwen3-0.6b-random-bf16"
PREFILL_LEN, DECODE_TOKENS, BATCH_PROMPT_LEN = 512, 64, 32


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def prompts(batch: int, length: int) -> list[list[int]]:
    return [[1000 + (7 * i + 13 * b) % 50000 for i in range(length)] for b in range(batch)]


def run_nanoqwen(model_dir: str, device: str, repeats: int, quantization: str | None = None) -> dict:
    from nanoqwen import LLM, SamplingParams
    from nanoqwen.models.qwen3 import Linear
    from nanoqwen.quantization import Int8Linear, weight_bytes

    # No prefix caching: the timed repeats send the same prompts, and transformers has nothing like it.
    llm = LLM(model_dir, dtype="bfloat16", device=device, max_model_len=PREFILL_LEN + DECODE_TOKENS + 8,
              max_num_seqs=16, max_num_batched_tokens=PREFILL_LEN * 16, enable_prefix_caching=False,
              quantization=quantization)

    def gen(batch: list[list[int]], n: int):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return lambda: llm.generate(batch, params, use_tqdm=False)

    # What a decode step reads in full: every projection and the LM head (of the embedding, one row a token).
    matrices = [m for m in llm.llm_engine.model.modules() if isinstance(m, Linear | Int8Linear)]
    return {**measure(gen, repeats), "weight_bytes": llm.llm_engine.weight_bytes,
            "decode_read_bytes": sum(weight_bytes(m) for m in matrices)}


def run_transformers(model_dir: str, device: str, repeats: int) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(device).eval()

    def gen(batch: list[list[int]], n: int):
        ids = torch.tensor(batch, device=device)  # equal lengths: no padding needed
        config = transformers.GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                               eos_token_id=None, pad_token_id=0)

        def call():
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return call

    size = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied head is counted once
    return {**measure(gen, repeats), "weight_bytes": size}


def measure(gen, repeats: int) -> dict:
    """The same procedure for both systems; gen(prompts, n) returns a call generating n tokens each."""
    long_prompt = prompts(1, PREFILL_LEN)
    gen(long_prompt, 2)()  # warm-up
    result = {"prefill_tok_s": PREFILL_LEN / best_of(gen(long_prompt, 1), repeats)}
    for batch in (1, 16):
        p = prompts(batch, BATCH_PROMPT_LEN)
        gen(p, 2)()
        first = best_of(gen(p, 1), repeats)
        full = best_of(gen(p, 1 + DECODE_TOKENS), repeats)
        result[f"decode_b{batch}_tok_s"] = batch * DECODE_TOKENS / (full - first)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def ceilings(device: str) -> dict:
    """This machine's limits: read bandwidth (sum of 1 GiB), the bf16 matrix-vector rate that decode
    at batch 1 is made of (GB of weights read per second), and bf16 matmul TFLOP/s."""
    import torch
    import torch.nn.functional as F

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn) -> float:
        fn()
        sync()
        return best_of(lambda: (fn(), sync()), 5)

    x = torch.ones(1 << 28, dtype=torch.float32, device=device)
    read = x.numel() * 4 / timed(x.sum) / 1e9
    del x
    w = torch.randn(8192, 32768, dtype=torch.bfloat16, device=device)
    v = torch.randn(1, 32768, dtype=torch.bfloat16, device=device)
    gemv = w.numel() * 2 / timed(lambda: F.linear(v, w)) / 1e9
    n = 4096 if device == "cuda" else 2048
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    flops = 2 * n**3 / timed(lambda: a @ a) / 1e12
    return {"read_gb_s": read, "gemv_gb_s": gemv, "bf16_tflop_s": flops}


def weight_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def child(system: str, model_dir: str, device: str, repeats: int) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    if system == "ceilings":
        result = ceilings(device)
    elif system.startswith("nanoqwen"):
        result = run_nanoqwen(model_dir, device, repeats, quantization="int8" if system == "nanoqwen-int8" else None)
    else:
        result = run_transformers(model_dir, device, repeats)
    print("RESULT " + json.dumps(result))


def run_child(system: str, model_dir: Path, device: str, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--child", system, "--model", str(model_dir), "--device", device,
           "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{system} benchmark failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def machine_line(device: str) -> str:
    import torch
    import transformers

    import nanoqwen

    if device == "cuda":
        hw = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                    if x.startswith("model name")), platform.processor())
        hw = f"{cpu}, {os.cpu_count()} threads"
    return (f"{datetime.date.today()} · {hw} · Python {platform.python_version()} · torch {torch.__version__} · "
            f"transformers {transformers.__version__} · nanoqwen {nanoqwen.__version__}")


def table(model_dir: Path, ours: dict, theirs: dict, ceil: dict, int8: dict) -> str:
    size = weight_bytes(model_dir)
    read_bound, gemv_bound = ceil["read_gb_s"] * 1e9 / size, ceil["gemv_gb_s"] * 1e9 / size
    int8_bound = ceil["read_gb_s"] * 1e9 / int8["decode_read_bytes"]
    rows = [  # (label, key, unit, digits)
        ("Prefill, 512-token prompt (tok/s)", "prefill_tok_s", 1, 1),
        ("Decode, batch 1 (tok/s)", "decode_b1_tok_s", 1, 1),
        ("Decode, batch 16 (tok/s, all sequences)", "decode_b16_tok_s", 1, 1),
        ("Peak memory (process max RSS, GiB)", "peak_rss_gib", 1, 1),
        ("Weights in memory (GB)", "weight_bytes", 1e9, 2),
    ]
    lines = ["| | nanoqwen | transformers | nanoqwen / transformers | nanoqwen int8 | int8 / nanoqwen |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, key, unit, d in rows:
        a, b, c = ours[key] / unit, theirs[key] / unit, int8[key] / unit
        lines.append(f"| {label} | {a:.{d}f} | {b:.{d}f} | {a / b:.2f}× | {c:.{d}f} | {c / a:.2f}× |")
    lines += ["", f"Ceilings measured in the same run: read bandwidth {ceil['read_gb_s']:.1f} GB/s (sum of 1 GiB); "
              f"torch's bf16 matrix-vector product reads weights at {ceil['gemv_gb_s']:.1f} GB/s; bf16 matmul "
              f"{ceil['bf16_tflop_s']:.2f} TFLOP/s. With {size / 1e9:.2f} GB of weights, batch-1 decode is bound "
              f"at {read_bound:.1f} tok/s by bandwidth and at {gemv_bound:.1f} tok/s by torch's bf16 "
              f"matrix-vector kernel; nanoqwen's batch-1 decode is {ours['decode_b1_tok_s'] / read_bound:.0%} "
              f"and {ours['decode_b1_tok_s'] / gemv_bound:.0%} of them. nanoqwen int8 (weight-only, quantised at "
              f"load; the bf16 embedding kept for the lookup) reads {int8['decode_read_bytes'] / 1e9:.2f} GB of "
              f"weights per decode step: bound at {int8_bound:.1f} tok/s by bandwidth; its batch-1 decode is "
              f"{int8['decode_b1_tok_s'] / int8_bound:.0%} of that."]
    return "\n".join(lines)


def write_benchmarks(section: str, body: str) -> None:
    """Replace (or append) the section between this script's markers in BENCHMARKS.md."""
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    block = f"{start}\n{body}\n{end}"
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=f"model folder (default: a random one in {DEFAULT_DIR})")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3, help="best of N timings")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.model, args.device, args.repeats)
    model_dir = Path(args.model) if args.model else DEFAULT_DIR
    if not (model_dir / "config.json").exists():
        from nanoqwen.init_random import write_random_model

        print(f"writing a random Qwen3-0.6B-shaped checkpoint to {model_dir} ...", file=sys.stderr)
        write_random_model(model_dir, "qwen3-0.6b", dtype="bfloat16", std=0.02)
    results = {}
    for system in ("ceilings", "nanoqwen", "nanoqwen-int8", "transformers"):
        print(f"running {system} ...", file=sys.stderr)
        results[system] = run_child(system, model_dir, args.device, args.repeats)
    body = (f"### Single-stream speed: prefill, decode at batch 1 and 16 ({args.device}, bfloat16)\n\n"
            f"`python bench/bench_model.py{' --device cuda' if args.device == 'cuda' else ''}` on "
            f"{'a random checkpoint with the exact Qwen3-0.6B shape' if not args.model else model_dir.name}; "
            f"transformers with sdpa attention, same token ids, greedy, EOS ignored; nanoqwen int8: "
            f"`quantization=\"int8\"` (weight-only int8 made at load from the same checkpoint).\n\n"
            f"{machine_line(args.device)}\n\n"
            + table(model_dir, results["nanoqwen"], results["transformers"], results["ceilings"],
                    results["nanoqwen-int8"]))
    print(body)
    if args.write:
        write_benchmarks(f"bench_model-{args.device}", body)


if __name__ == "__main__":
    main()
