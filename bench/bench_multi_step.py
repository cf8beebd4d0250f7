"""What greedy multi-step decode buys (EngineConfig.num_scheduler_steps): batch-1 decode with K steps in one go
against one step at a time, on one engine, in one run.

    python bench/bench_multi_step.py                          # int4, K = 4, 8, 16 against 1
    python bench/bench_multi_step.py --quantization none --steps 8 --rounds 30

One LLM on the random Qwen3-0.6B-shaped checkpoint decodes 64 tokens after a 32-token prompt, greedy, EOS ignored
(bench_llamacpp.py's decode), with the scheduler's num_scheduler_steps switched between calls: each round times
every K once (the order reversed every other round), each as a generate of 65 tokens minus a generate of 1 (the
prefill). The same weights and the same memory for every K, and neighbouring timings seconds apart: this machine's
speed drifts by more than the difference within minutes, so the speed-up is the median of the rounds' ratios
(quartiles beside it). The greedy tokens must be the same for every K; the script says if they are not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (its checkpoint, prompts and machine line)

DECODE_TOKENS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=f"model folder (default: {bench_model.DEFAULT_DIR})")
    parser.add_argument("--quantization", choices=["none", "int8", "int4"], default="int4")
    parser.add_argument("--steps", default="4,8,16", help="values of K to time against 1, comma-separated")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()

    from nanoqwen import LLM, SamplingParams

    model_dir = Path(args.model) if args.model else bench_model.DEFAULT_DIR
    bench_model.ensure_checkpoint(model_dir)
    llm = LLM(str(model_dir), dtype="bfloat16", device="cpu", enable_prefix_caching=False,
              max_model_len=args.prompt_len + DECODE_TOKENS + 8,
              quantization=None if args.quantization == "none" else args.quantization)
    prompt = bench_model.prompts(1, args.prompt_len)
    scheduler = llm.llm_engine.scheduler
    ks = [1, *(int(k) for k in args.steps.split(","))]

    def generate(k: int, n: int) -> tuple[float, list[int]]:
        scheduler.num_scheduler_steps = k  # (EngineConfig.num_scheduler_steps, switched on the live engine)
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - start, out[0].outputs[0].token_ids

    for k in ks:  # warm-up
        generate(k, 1 + DECODE_TOKENS)
    step_time: dict[int, list[float]] = {k: [] for k in ks}
    tokens: dict[int, list[int]] = {}
    for r in range(args.rounds):
        for k in ks if r % 2 == 0 else ks[::-1]:
            prefill, _ = generate(k, 1)
            total, tokens[k] = generate(k, 1 + DECODE_TOKENS)
            step_time[k].append((total - prefill) / DECODE_TOKENS)
    same = all(tokens[k] == tokens[1] for k in ks)
    lines = [f"`python bench/bench_multi_step.py --quantization {args.quantization} --steps {args.steps} --rounds "
             f"{args.rounds}`, batch 1, {args.prompt_len}-token prompt, {DECODE_TOKENS} tokens; greedy tokens the "
             f"same for every K: {'yes' if same else 'NO'}.", "", bench_model.machine_line("cpu"), "",
             "| num_scheduler_steps | ms a token (median) | tok/s | speed against 1 (median of rounds) | quartiles |",
             "|---:|---:|---:|---:|---|"]
    for k in ks:
        ratios = sorted(one / t for one, t in zip(step_time[1], step_time[k], strict=True))
        q = statistics.quantiles(ratios, n=4)
        median = statistics.median(step_time[k])
        lines.append(f"| {k} | {median * 1e3:.2f} | {1 / median:.1f} | {statistics.median(ratios):.3f}× | "
                     f"{q[0]:.3f}–{q[2]:.3f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
