"""nanoqwen vs transformers on one machine, in one run: prefill, decode at batch 1 and 16, peak memory.
nanoqwen runs three times: with the checkpoint's bf16 weights and with `quantization="int8"` and `"int4"`
(weight-only, made at load).

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
import shlex
import subprocess
import sys
import time
from functools import partial
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


def run_nanoqwen(model_dir: str, device: str, repeats: int, quantization: str | None = None,
                 enforce_eager: bool = False, batches: tuple[int, ...] = (1, 16)) -> dict:
    gen, info = load_nanoqwen(model_dir, device, quantization, enforce_eager)
    return {**measure(gen, repeats, batches), **info}


def load_nanoqwen(model_dir: str, device: str, quantization: str | None = None, enforce_eager: bool = False,
                  num_scheduler_steps: int = 1):
    """nanoqwen on the checkpoint: gen(prompts, n) (a call generating n tokens for each prompt, greedy, EOS
    ignored) and what the tables need to know of the model (its weight bytes, the bytes a decode step reads,
    the multiply-adds a token costs). num_scheduler_steps: greedy decode steps run in one go (EngineConfig)."""
    from nanoqwen import LLM, SamplingParams
    from nanoqwen.layers.experts import Experts
    from nanoqwen.layers.linear import Linear
    from nanoqwen.quantization import Int4Experts, weight_bytes

    # No prefix caching: the timed repeats send the same prompts, and transformers has nothing like it.
    # On GPU, decode steps replay CUDA graphs unless enforce_eager.
    llm = LLM(model_dir, dtype="bfloat16", device=device, max_model_len=PREFILL_LEN + DECODE_TOKENS + 8,
              max_num_seqs=16, max_num_batched_tokens=PREFILL_LEN * 16, enable_prefix_caching=False,
              quantization=quantization, enforce_eager=enforce_eager, num_scheduler_steps=num_scheduler_steps)

    def gen(batch: list[list[int]], n: int):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return lambda: llm.generate(batch, params, use_tqdm=False)

    # What a decode step reads in full: every projection and the LM head (of the embedding, one row a token);
    # of a MoE layer's experts, the K of E that the token is routed to.
    model = llm.llm_engine.model
    matrices = [m for m in model.modules() if isinstance(m, Linear)]  # (quantised ones too)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    active = model.config.num_experts_per_tok / model.config.num_experts if experts else 0.0
    # 16 tokens routed uniformly (as random weights route) reach 1 - (1 - K/E)^16 of the experts, not 16 K/E
    active16 = 1 - (1 - active) ** 16
    dense_bytes, expert_bytes = sum(weight_bytes(m) for m in matrices), sum(map(weight_bytes, experts))
    info = {"weight_bytes": llm.llm_engine.weight_bytes, "kernel_path": llm.llm_engine.kernel_path,
            "decode_read_bytes": dense_bytes + active * expert_bytes,
            "decode_b16_read_bytes": dense_bytes + active16 * expert_bytes,
            # multiply-adds per token in the projections (a prompt's LM head runs for its last token only)
            "layer_params": sum(map(params, (m for m in matrices if m is not model.lm_head)))
            + active * sum((m.gate_up_proj.numel() + m.down_proj.numel()) * (2 if isinstance(m, Int4Experts) else 1)
                           for m in experts),  # (int4 holds two weights a byte)
            "head_params": params(model.lm_head)}
    return gen, info


def params(linear) -> int:
    """Weights of a Linear (or its quantised version: int4 packs two a byte)."""
    return linear.weight.shape[0] * getattr(linear, "in_features", linear.weight.shape[1])


def run_transformers(model_dir: str, device: str, repeats: int, dtype: str = "bfloat16") -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa").to(device).eval()

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


def measure(gen, repeats: int, batches: tuple[int, ...] = (1, 16)) -> dict:
    """The same procedure for both systems; gen(prompts, n) returns a call generating n tokens each."""
    long_prompt = prompts(1, PREFILL_LEN)
    gen(long_prompt, 2)()  # warm-up
    result = {"prefill_tok_s": PREFILL_LEN / best_of(gen(long_prompt, 1), repeats)}
    for batch in batches:
        p = prompts(batch, BATCH_PROMPT_LEN)
        gen(p, 2)()
        first = best_of(gen(p, 1), repeats)
        full = best_of(gen(p, 1 + DECODE_TOKENS), repeats)
        result[f"decode_b{batch}_tok_s"] = batch * DECODE_TOKENS / (full - first)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


PEAK_SIZE = 2048  # the square products that measure a matmul's peak (bench_batch_decode, bench_long_context)


def square_matmul_tops(dtype, repeats: int = 5) -> float:
    """TFLOP/s (TOP/s for int8, through torch._int_mm) of a PEAK_SIZE^3 product on CPU: best of `repeats` after a
    warm-up, or the warm-up alone where it takes over a second (bf16 on a CPU without bf16 instructions)."""
    import torch

    n = PEAK_SIZE
    if dtype == torch.int8:
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        product = lambda: torch._int_mm(a, a)  # noqa: E731
    else:
        a = torch.randn(n, n).to(dtype)
        product = lambda: a @ a  # noqa: E731
    once = best_of(product, 1)  # (warm-up: oneDNN picks its kernel)
    return 2 * n**3 / (once if once > 1 else best_of(product, repeats)) / 1e12


def read_bandwidth(device: str = "cpu") -> float:
    """GB/s of a torch sum over 1 GiB of float32, best of five after a warm-up: the read bandwidth that
    bounds decode."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.ones(1 << 28, dtype=torch.float32, device=device)
    x.sum()
    sync()
    return sum_bandwidth(x, 5, sync)


def sum_bandwidth(x, repeats: int, sync=lambda: None) -> float:
    """GB/s of a torch sum over the float32 tensor x (already warmed up), best of `repeats`."""
    return x.numel() * 4 / best_of(lambda: (x.sum(), sync()), repeats) / 1e9


def ceilings(device: str) -> dict:
    """This machine's limits: read bandwidth (sum of 1 GiB), copy bandwidth (1 GiB, read + write), the bf16
    matrix-vector rate that decode at batch 1 is made of (GB of weights read per second), bf16 matmul TFLOP/s."""
    import torch
    import torch.nn.functional as F

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn) -> float:
        fn()
        sync()
        return best_of(lambda: (fn(), sync()), 5)

    read = read_bandwidth(device)
    x = torch.ones(1 << 28, dtype=torch.float32, device=device)
    y = torch.empty_like(x).fill_(0)  # touched, so the copy measures memory, not page faults
    copy = 2 * x.numel() * 4 / timed(partial(y.copy_, x)) / 1e9  # bytes read + bytes written
    del x, y
    w = torch.randn(8192, 32768, dtype=torch.bfloat16, device=device)
    v = torch.randn(1, 32768, dtype=torch.bfloat16, device=device)
    gemv = w.numel() * 2 / timed(lambda: F.linear(v, w)) / 1e9
    n = 4096 if device == "cuda" else 2048
    a = torch.randn(n, n, dtype=torch.float32, device=device)
    f32_flops = 2 * n**3 / timed(lambda: a @ a) / 1e12
    b = a[:512, :512].bfloat16().contiguous()
    flops = 2 * 512**3 / timed(lambda: b @ b) / 1e12
    if flops > 0.05:  # fast bf16 (a GPU, or a CPU with native bf16): measure at full size; a CPU without runs
        a = a.bfloat16()  # bf16 at a few GFLOP/s, where 2048^3 would take minutes
        flops = 2 * n**3 / timed(lambda: a @ a) / 1e12
    return {"read_gb_s": read, "copy_gb_s": copy, "gemv_gb_s": gemv, "bf16_tflop_s": flops,
            "f32_tflop_s": f32_flops}


def child(system: str, model_dir: str, device: str, repeats: int, transformers_dtype: str = "bfloat16") -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    if system == "ceilings":
        result = ceilings(device)
    elif system.startswith("nanoqwen"):
        method = system.partition("-")[2]
        result = run_nanoqwen(model_dir, device, repeats, quantization=method if method in ("int8", "int4") else None,
                              enforce_eager=method == "eager")
    else:
        result = run_transformers(model_dir, device, repeats, transformers_dtype)
    print("RESULT " + json.dumps(result))


def run_child(system: str, model_dir: Path, device: str, repeats: int, transformers_dtype: str = "bfloat16") -> dict:
    cmd = [sys.executable, __file__, "--child", system, "--model", str(model_dir), "--device", device,
           "--repeats", str(repeats), "--transformers-dtype", transformers_dtype]
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
        from nanoqwen.ops.cpu.cpu_info import cpu_name_and_flags, isa_summary

        name, flags = cpu_name_and_flags()
        hw = (f"{name or platform.processor()} (flags: {isa_summary(flags)}; torch's CPU capability "
              f"{torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} threads")
    return (f"{datetime.date.today()} · {hw} · Python {platform.python_version()} · torch {torch.__version__} · "
            f"transformers {transformers.__version__} · nanoqwen {nanoqwen.__version__} · commit {commit()}")


def commit() -> str:
    """The commit measured: git's short hash, "+changes" where the working tree differs from it
    (BENCHMARKS.md aside: the benchmarks write it)."""
    def git(*args: str) -> str:
        result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!BENCHMARKS.md")
    return head + ("+changes" if changed else "")


def bounds(ours: dict, ceil: dict) -> dict:
    """What the hardware allows for each row (tok/s): decode reads every weight once a step (bandwidth bound),
    prefill and batch-16 decode multiply-add every weight once per token (matmul bound)."""
    # (a CPU without fast bf16 computes 16-bit prefill in float32: nanoqwen/ops/cpu/matmul.py)
    flops, read = max(ceil["bf16_tflop_s"], ceil.get("f32_tflop_s", 0.0)) * 1e12, ceil["read_gb_s"] * 1e9
    per_token = 2 * ours["layer_params"]  # FLOPs per prompt token (the head runs for the last one only)
    return {"prefill_tok_s": flops / per_token,
            "decode_b1_tok_s": read / ours["decode_read_bytes"],
            "decode_b16_tok_s": min(16 * read / ours["decode_b16_read_bytes"],
                                    flops / (per_token + 2 * ours["head_params"]))}


def table(ours: dict, theirs: dict, ceil: dict, quantized: dict[str, dict], eager: dict | None = None) -> str:
    """quantized: nanoqwen's results per quantisation method ("int8", "int4"), three columns each; eager: nanoqwen
    with enforce_eager (GPU runs), an extra column when given."""
    rows = [  # (label, key, unit, digits)
        ("Prefill, 512-token prompt (tok/s)", "prefill_tok_s", 1, 1),
        ("Decode, batch 1 (tok/s)", "decode_b1_tok_s", 1, 1),
        ("Decode, batch 16 (tok/s, all sequences)", "decode_b16_tok_s", 1, 1),
        ("Peak memory (process max RSS, GiB)", "peak_rss_gib", 1, 1),
        ("Weights in memory (GB)", "weight_bytes", 1e9, 2),
    ]
    limit = bounds(ours, ceil)
    limits = {method: bounds(r, ceil) for method, r in quantized.items()}
    eager_head = " nanoqwen (--enforce-eager) |" if eager else ""
    lines = [f"| | nanoqwen |{eager_head} transformers | nanoqwen / transformers | ceiling | nanoqwen / ceiling | "
             "transformers / ceiling |" + "".join(f" nanoqwen {m} | {m} / nanoqwen | {m} / its ceiling |"
                                                  for m in quantized),
             "|---|---:|" + "---:|" * (bool(eager) + 5 + 3 * len(quantized))]
    for label, key, unit, d in rows:
        a, b = ours[key] / unit, theirs[key] / unit
        e = f" {eager[key] / unit:.{d}f} |" if eager else ""
        bound = f"{limit[key]:.1f} | {a / limit[key]:.0%} | {b / limit[key]:.0%}" if key in limit else " | | "
        line = f"| {label} | {a:.{d}f} |{e} {b:.{d}f} | {a / b:.2f}× | {bound} |"
        for method, r in quantized.items():
            c = r[key] / unit
            line += f" {c:.{d}f} | {c / a:.2f}× | {f'{c / limits[method][key]:.0%}' if key in limit else ''} |"
        lines.append(line)
    quantized_reads = ", ".join(f"{m} {r['decode_read_bytes'] / 1e9:.2f} GB" for m, r in quantized.items())
    moe_note = (" (a MoE model: the experts that 16 uniformly routed tokens are expected to reach; batch 1 reads "
                "the K experts of its token)" if ours["decode_b16_read_bytes"] != ours["decode_read_bytes"] else "")
    lines += ["", f"Ceilings measured in the same run: read bandwidth {ceil['read_gb_s']:.1f} GB/s (sum of 1 GiB), "
              f"copy {ceil['copy_gb_s']:.1f} GB/s (1 GiB, bytes read + written), torch's bf16 matrix-vector product "
              f"{ceil['gemv_gb_s']:.1f} GB/s of weights, matmul {ceil['bf16_tflop_s'] * 1e3:.0f} GFLOP/s in bf16, "
              f"{ceil.get('f32_tflop_s', 0) * 1e3:.0f} in float32. "
              f"The ceiling column: batch-1 decode reads {ours['decode_read_bytes'] / 1e9:.2f} GB of weights a step "
              f"(bf16; {quantized_reads}) at the read bandwidth; prefill does "
              f"{2 * ours['layer_params'] / 1e9:.2f} GFLOP a token at the matmul rate; batch-16 decode is the "
              f"lower of the matmul bound (LM head included) and reading "
              f"{ours['decode_b16_read_bytes'] / 1e9:.2f} GB a step{moe_note}. At torch's own bf16 "
              f"matrix-vector rate, batch-1 decode would be bound at "
              f"{ceil['gemv_gb_s'] * 1e9 / ours['decode_read_bytes']:.1f} tok/s."]
    return "\n".join(lines)


def section_name(script: str, device: str) -> str:
    """The BENCHMARKS.md section of a script's table: one per device, and on CPU one per CPU class
    (amx: AMX tiles, an Intel Xeon's; avx512-bf16: AVX-512 with native bf16 dot products; avx512; avx2), e.g.
    bench_model-cpu-avx2; a bigger CPU limited to AVX2 (ATEN_CPU_CAPABILITY=avx2) gets its own, e.g.
    bench_model-cpu-amx-as-avx2."""
    if device != "cpu":
        return f"{script}-{device}"
    from nanoqwen.ops.cpu.cpu_info import cpu_name_and_flags

    flags = cpu_name_and_flags()[1]
    cpu_class = ("amx" if "amx_bf16" in flags else "avx512-bf16" if "avx512_bf16" in flags
                 else "avx512" if "avx512f" in flags else "avx2")
    if cpu_class != "avx2" and os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":
        cpu_class += "-as-avx2"
    return f"{script}-cpu-{cpu_class}"


# Environment variables that change what a run measures, shown before its command where set: the llama-cpp-python
# build on the path, and the limits that make a bigger CPU run as an AVX2-only one.
RUN_ENV = ("PYTHONPATH", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def command_line(script: str, argv: list[str]) -> str:
    """A run's command for the record, without --write and the model path (named in the text
    instead), after the RUN_ENV variables it ran with (paths inside the repository relative to it)."""
    env = []
    for name in RUN_ENV:
        value = os.environ.get(name)
        if value and name == "PYTHONPATH":
            inside = [Path(v).resolve() for v in value.split(":")]
            value = ":".join(str(v.relative_to(ROOT)) if v.is_relative_to(ROOT) else str(v) for v in inside)
        if value:
            env.append(f"{name}={shlex.quote(value)}")
    shown, skip = [*env, f"python bench/{script}"], False
    for arg in argv:
        if skip or arg == "--write" or arg.startswith("--model="):
            skip = False
            continue
        skip = arg == "--model"
        if not skip:
            shown.append(shlex.quote(arg))  # (a --systems name with spaces, as a shell takes it)
    return " ".join(shown)


def write_benchmarks(section: str, body: str) -> None:
    """Replace the section between this script's markers in BENCHMARKS.md. A new one goes at the end of its
    machine class's part (the "## " heading below, up to the next one): a run limited to AVX2 at the very end,
    any other before the part's "### Limited to AVX2" sub-section; at the end of the file for a class without
    a part of its own."""
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    block = f"{start}\n{body}\n{end}"
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        headings = {"cpu-amx": "## Intel Xeon with AMX", "cpu-avx512-bf16": "## AMD EPYC with AVX-512 and bf16",
                    "cpu-avx2": "## AMD EPYC, AVX2 only", "cuda": "## NVIDIA H200 (GPU)"}
        heading = next((h for c, h in headings.items() if f"-{c}-" in f"{section}-"), None)
        at = len(text)
        if heading and f"\n{heading}" in text:
            part = text.index(f"\n{heading}") + 1
            next_part = text.find("\n## ", part)
            at = next_part + 1 if next_part >= 0 else len(text)
            limited = text.find("\n### Limited to AVX2", part, at)
            if limited >= 0 and "-as-avx2" not in section:
                at = limited + 1
        rest = text[at:]
        text = text[:at].rstrip("\n") + "\n\n" + block + "\n" + ("\n" + rest if rest else "")
    path.write_text(text)


def ensure_checkpoint(model_dir: Path) -> None:
    """Write the random Qwen3-0.6B-shaped checkpoint to model_dir unless it has one."""
    if not (model_dir / "config.json").exists():
        from nanoqwen.model_loader.init_random import write_random_model

        print(f"writing a random Qwen3-0.6B-shaped checkpoint to {model_dir} ...", file=sys.stderr)
        write_random_model(model_dir, "qwen3-0.6b", dtype="bfloat16", std=0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=f"model folder (default: a random one in {DEFAULT_DIR})")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3, help="best of N timings")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--transformers-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="transformers' dtype (float32: its faster choice on a CPU without fast bf16, where "
                             "its bf16 matmuls are very slow)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.model, args.device, args.repeats, args.transformers_dtype)
    model_dir = Path(args.model) if args.model else DEFAULT_DIR
    ensure_checkpoint(model_dir)
    results = {}
    systems = ["ceilings", "nanoqwen", "nanoqwen-int8", "nanoqwen-int4", "transformers"]
    if args.device == "cuda":
        systems.insert(2, "nanoqwen-eager")
    for system in systems:  # a failing system does not stop the others: their results are printed as they come
        print(f"running {system} ...", file=sys.stderr)
        try:
            results[system] = run_child(system, model_dir, args.device, args.repeats, args.transformers_dtype)
        except SystemExit as e:
            print(e, file=sys.stderr)
            continue
        print(f"{system}: {json.dumps(results[system])}", file=sys.stderr, flush=True)
    missing = [s for s in systems if s not in results]
    if missing:
        sys.exit(f"no table: {', '.join(missing)} failed")
    body = (f"### Single-stream speed{f' of {model_dir.name}' if args.model else ''}: prefill, decode at batch 1 "
            f"and 16 ({args.device}, bfloat16)\n\n"
            f"`python bench/bench_model.py{' --device cuda' if args.device == 'cuda' else ''}"
            f"{f' --model {args.model}' if args.model else ''}` on "
            f"{'a random checkpoint with the exact Qwen3-0.6B shape' if not args.model else model_dir.name}; "
            f"transformers with sdpa attention"
            f"{' in float32 (its faster choice on this CPU)' if args.transformers_dtype == 'float32' else ''}, "
            f"same token ids, greedy, EOS ignored; nanoqwen int8 / int4: "
            f"`quantization=\"int8\"` / `\"int4\"` (weight-only, made at load from the same checkpoint).\n\n"
            f"{machine_line(args.device)}\n\n"
            + table(results["nanoqwen"], results["transformers"], results["ceilings"],
                    {m: results[f"nanoqwen-{m}"] for m in ("int8", "int4")}, results.get("nanoqwen-eager")))
    print(body)
    if args.write:  # one section per CPU class; a --model gets its own section (the default one is the 0.6B)
        write_benchmarks(section_name("bench_model", args.device) + (f"-{model_dir.name}" if args.model else ""),
                         body)


if __name__ == "__main__":
    main()
