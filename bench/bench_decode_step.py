"""What each of nanoqwen's own CPU decode kernels buys: the batch-1 decode step with each of them switched back
to torch's ops, one at a time, in one process and one run (nanoqwen/ops/cpu/kernels.py).

    python bench/bench_decode_step.py            # random Qwen3-0.6B-shaped checkpoint, bf16 and int4
    python bench/bench_decode_step.py --write    # also record the table in BENCHMARKS.md
    python bench/bench_decode_step.py --prompt-len 2000   # a long context: attention's share grows

Configurations (each a decode step of one sequence after a --prompt-len prompt (32 tokens unless given),
32 steps, best of --repeats):
- all own kernels: what the engine chooses on a CPU without fast bf16 (all decoder layers in one C++ call,
  worker/fused_decoder.py);
- per-module calls: the same kernels called from the model's modules, one by one (NANOQWEN_FUSED_DECODE=0);
- then, per module, one kind of kernel switched back to torch's: attention (gathers each sequence's blocks
  and calls SDPA), elementwise (RMSNorm, RoPE and SwiGLU as the plain functions of models/qwen3.py, 5-9 ops
  each), gemv (bf16 only: the projections through torch's F.linear instead of bf16_gemv);
- per-module calls, no matmuls: every projection and the LM head replaced by an empty output: what the step
  costs besides the matrix products.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (its checkpoint, machine line and BENCHMARKS.md sections)

STEPS = 32


def step_ms(llm, repeats: int, prompt_len: int) -> float:
    from nanoqwen import SamplingParams

    prompt = bench_model.prompts(1, prompt_len)

    def gen(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    gen(4)
    return min(gen(1 + STEPS) - gen(1) for _ in range(repeats)) / STEPS * 1e3


def measure(model_dir: Path, quantization: str | None, repeats: int, prompt_len: int) -> dict[str, float]:
    from nanoqwen import LLM
    from nanoqwen.layers.linear import Linear
    from nanoqwen.models import qwen3
    from nanoqwen.ops.cpu.matmul import MatmulPath

    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=prompt_len + STEPS + 64, enable_prefix_caching=False,
              quantization=quantization)
    runner, model = llm.llm_engine.runner, llm.llm_engine.model
    own = model.kernels
    if runner.attention_backend != "cpu":
        sys.exit(f"nanoqwen's own decode kernels are not on here ({llm.llm_engine.kernel_path})")

    def use_kernels(kernels: qwen3.Kernels) -> None:  # the engine's choice swapped in every module that holds it
        for module in model.modules():
            if getattr(module, "kernels", None) is not None:
                module.kernels = kernels

    results = {"all own kernels": step_ms(llm, repeats, prompt_len)}
    runner.fused_decoder = None
    results["per-module calls"] = step_ms(llm, repeats, prompt_len)
    runner.attention_backend = None
    results["per module, torch attention"] = step_ms(llm, repeats, prompt_len)
    runner.attention_backend = "cpu"
    use_kernels(qwen3.Kernels(matmul=own.matmul))
    results["per module, torch elementwise"] = step_ms(llm, repeats, prompt_len)
    use_kernels(own)
    if quantization is None:
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        for linear in linears:
            linear.matmul_path = MatmulPath(own.matmul.path, own.matmul.reason)
        results["per module, torch gemv"] = step_ms(llm, repeats, prompt_len)
        for linear in linears:
            linear.matmul_path = own.matmul
    for module in model.modules():
        if isinstance(module, Linear):
            module.matmul = (lambda m: lambda x, bias: x.new_empty(*x.shape[:-1], m.weight.shape[0]))(module)
    results["per-module calls, no matmuls"] = step_ms(llm, repeats, prompt_len)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens in the context before the decode steps")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    args = parser.parse_args()
    model_dir = bench_model.DEFAULT_DIR
    bench_model.ensure_checkpoint(model_dir)
    columns = {"bf16": measure(model_dir, None, args.repeats, args.prompt_len),
               "int4": measure(model_dir, "int4", args.repeats, args.prompt_len)}
    rows = list(columns["bf16"])
    lines = ["| batch-1 decode step (ms) | bf16 | int4 |", "|---|---:|---:|"]
    for row in rows:
        cells = [f"{c[row]:.1f}" if row in c else "–" for c in columns.values()]
        lines.append(f"| {row} | {' | '.join(cells)} |")
    command = "python bench/bench_decode_step.py"
    if args.prompt_len != 32:
        command += f" --prompt-len {args.prompt_len}"
    body = (f"### What nanoqwen's own CPU decode kernels buy\n\n`{command}`: the decode step of one sequence "
            f"(Qwen3-0.6B shape, random weights, {args.prompt_len}-token prompt, {STEPS} steps, best of "
            f"{args.repeats}), each kernel switched back to torch's ops in turn, in one process.\n\n"
            f"{bench_model.machine_line('cpu')}\n\n" + "\n".join(lines))
    print(body)
    if args.write:
        name = "bench_decode_step" if args.prompt_len == 32 else f"bench_decode_step-context{args.prompt_len}"
        bench_model.write_benchmarks(bench_model.section_name(name, "cpu"), body)


if __name__ == "__main__":
    main()
