"""What structured outputs cost: the decode step with every row constrained by a JSON schema against
the same step unconstrained, at batch 1 and 16, and the grammar compile time of the test schemas.

    python bench/bench_structured.py              # random checkpoint with the exact Qwen3-0.6B shape
    python bench/bench_structured.py --write      # also record the table in BENCHMARKS.md

The steps are timed one by one through `LLMEngine.step()` once every sequence is decoding (prefill
done), so the figure is the per-step cost the constraint adds: the bitmask of each constrained row
from llguidance, the -inf fill of the logits outside it (sampler.py), and feeding the sampled token
back to the matcher. The constraint is a JSON object with one long free string ({"text": "..."}):
inside the string nearly every token is allowed, the most expensive mask to apply; a random model
keeps writing it for the whole measurement (ignore_eos, max_tokens past the measured steps).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (bench/ is not a package: its machine line and BENCHMARKS.md writer)

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 100000}},
          "required": ["text"], "additionalProperties": False}


def step_times(engine, batch: int, structured, steps: int, warmup: int = 3) -> list[float]:
    """Seconds of each of `steps` decode steps of `batch` sequences (after their prefill and
    `warmup` steps)."""
    from nanoqwen import SamplingParams

    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps + warmup + 8,
                            structured_outputs=structured)
    ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [785 + i, 6722, 315, 9625, 374], params)
    while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
        engine.step()
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if len(engine.scheduler.running) != batch:  # a row whose grammar ended would shrink the step
        sys.exit(f"only {len(engine.scheduler.running)} of {batch} sequences ran every step")
    for request_id in ids:
        engine.abort_request(request_id)
    return times


def compile_times(engine) -> dict[str, float]:
    """Milliseconds to compile each test schema (a fresh compiler: nothing cached)."""
    sys.path.insert(0, str(bench_model.ROOT / "tests"))
    from test_structured_outputs import SCHEMAS

    from nanoqwen.sample.structured_outputs import GrammarCompiler
    from nanoqwen.sampling_params import StructuredOutputsParams

    compiler = GrammarCompiler(engine.tokenizer, engine.config.vocab_size, engine.eos_token_ids)
    start = time.perf_counter()
    _ = compiler.ll_tokenizer  # built once per engine, on first use
    out = {"(the llguidance tokenizer, once per engine)": (time.perf_counter() - start) * 1e3}
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        out[name] = (time.perf_counter() - start) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: a random Qwen3-0.6B)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per measurement")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else bench_model.DEFAULT_DIR
    if args.model is None:
        bench_model.ensure_checkpoint(model_dir)

    from nanoqwen import LLM
    from nanoqwen.sampling_params import StructuredOutputsParams

    engine = LLM(str(model_dir), device=args.device, max_num_seqs=16,
                 enable_prefix_caching=False).llm_engine
    constraint = StructuredOutputsParams(json=SCHEMA)
    rows = []
    for batch in (1, 16):
        free = statistics.median(step_times(engine, batch, None, args.steps))
        constrained = statistics.median(step_times(engine, batch, constraint, args.steps))
        rows.append(f"| {batch} | {free * 1e3:.1f} | {constrained * 1e3:.1f} | "
                    f"{(constrained - free) * 1e3:+.1f} | {(constrained / free - 1) * 100:+.1f}% |")
    compiled = compile_times(engine)
    body = "\n".join([
        f"### Structured outputs: the cost of a constrained decode step ({args.device}, "
        f"{str(engine.dtype).removeprefix('torch.')})", "",
        f"`python bench/bench_structured.py` on {model_dir.name}: the median of {args.steps} decode "
        "steps, every row constrained to a JSON object with one free string (nearly every token "
        "allowed: the widest mask) against the same steps unconstrained, in one process.", "",
        bench_model.machine_line(args.device), "",
        "| batch | unconstrained step (ms) | constrained step (ms) | difference (ms) | cost |",
        "|---:|---:|---:|---:|---:|", *rows, "",
        "Grammar compile time of the test schemas (tests/sample/test_structured_outputs.py), a fresh "
        "compiler, milliseconds: " + ", ".join(f"{k} {v:.1f}" for k, v in compiled.items()) + ".",
    ])
    print(body)
    if args.write:
        bench_model.write_benchmarks(bench_model.section_name("bench_structured", args.device), body)


if __name__ == "__main__":
    main()
