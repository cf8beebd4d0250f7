"""The `nanoqwen` command: chat, generate, init-random."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from nanoqwen.config import add_engine_args, engine_config_from_args
from nanoqwen.errors import NanoQwenError


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults: the model's generation_config.json)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens to generate (default: no limit)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)


def build_llm(args: argparse.Namespace):
    from nanoqwen.llm import LLM

    return LLM.from_config(engine_config_from_args(args))


def sampling_params(llm, args: argparse.Namespace):
    """The model's recommended sampling, with every flag the user gave on top."""
    from dataclasses import replace

    given = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p", "min_p")
             if getattr(args, name) is not None}
    return replace(llm.get_default_sampling_params(), max_tokens=args.max_tokens, **given)


def cmd_generate(args: argparse.Namespace) -> None:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    llm = build_llm(args)
    params = sampling_params(llm, args)
    if not args.no_chat_template:
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=True, enable_thinking=not args.no_think)
    last = None  # the last output carries the metrics
    for delta, last in llm.stream(prompt, params):  # noqa: B007
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if last is not None and not args.quiet:  # the speed, on stderr (as llama.cpp's CLI prints it)
        sys.stdout.flush()
        print(speed_line(llm, last), file=sys.stderr)


def speed_line(llm, output) -> str:
    """One line: prefill and decode speed, the weights' format and the kernel path chosen."""
    from nanoqwen.outputs import speed_summary

    engine, m = llm.llm_engine, output.metrics
    first = m.first_token_time if m.first_token_time is not None else m.arrival_time
    speed = speed_summary(len(output.prompt_token_ids), first - m.arrival_time,
                          len(output.token_ids), (m.last_token_time or first) - first)
    weights = engine.quantization or str(engine.dtype).removeprefix("torch.")
    size = sum(engine.rank_weight_bytes) / 2**30
    return f"[{speed} · {weights} weights, {size:.2f} GiB · kernels: {engine.kernel_path}]"


def cmd_chat(args: argparse.Namespace) -> None:
    from nanoqwen.chat import chat_loop

    llm = build_llm(args)
    chat_loop(llm, sampling_params(llm, args), enable_thinking=not args.no_think,
              system=args.system)


def cmd_init_random(args: argparse.Namespace) -> None:
    from nanoqwen.init_random import write_random_model

    out = write_random_model(args.dir, args.preset, dtype=args.dtype, std=args.std, seed=args.seed)
    print(f"wrote a random-weight {args.preset} model to {out}")


def cmd_bench(args: argparse.Namespace) -> None:
    import json

    from nanoqwen import benchmark

    benchmark.resolve_bench_args(args)
    # checks the flags before any model is made or loaded
    workload = benchmark.workload_from_args(args)
    engine_kwargs = benchmark.engine_kwargs_from_args(args)
    if args.model is None:
        args.model = benchmark.default_checkpoint_dir()
        if not (args.model / "config.json").exists():
            print(f"writing a random Qwen3-0.6B-shaped checkpoint to {args.model} (first use) ...",
                  file=sys.stderr)
        benchmark.ensure_random_checkpoint(args.model)
        print(f"model: random Qwen3-0.6B-shaped checkpoint in {args.model}", file=sys.stderr)
    print(f"running {len(workload)} requests ...", file=sys.stderr)
    result = benchmark.run_nanoqwen(args.model, workload, args.device, args.dtype, **engine_kwargs)
    if args.json:
        print(json.dumps({"model": str(args.model), **result}, indent=2, default=str))
    else:
        print(benchmark.format_report(result, args.model, args))


def cmd_serve(args: argparse.Namespace) -> None:
    from nanoqwen.server.run import serve

    serve(args)


def build_parser() -> argparse.ArgumentParser:
    from nanoqwen.benchmark import add_bench_args
    from nanoqwen.init_random import PRESETS

    parser = argparse.ArgumentParser(prog="nanoqwen",
                                     description="Run Qwen3 models: chat, generate, serve.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    add_engine_args(p)
    p.set_defaults(max_num_seqs=1)  # one conversation
    add_sampling_args(p)
    p.add_argument("--no-think", action="store_true",
                   help="start with thinking off (/think turns it on)")
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("generate", help="one answer to one prompt, streamed to stdout")
    add_engine_args(p)
    p.set_defaults(max_num_seqs=1)  # one prompt
    add_sampling_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text, or - to read it from stdin")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--no-think", action="store_true", help="answer without a thinking part")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no speed line on stderr at the end "
                        "(prefill and decode speed, weights, kernels)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("init-random",
                       help="write a model folder with random weights (for offline use)")
    p.add_argument("dir", help="output folder")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--std", type=float, default=0.02,
                   help="standard deviation of the random weights")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_init_random)

    p = sub.add_parser("bench", help="throughput on N random requests (like nano-vllm's bench.py)")
    p.add_argument("--model", default=None,
                   help="model folder or hub id (default: a random Qwen3-0.6B-shaped checkpoint, "
                        "made on first use in ~/.cache/nanoqwen/random-qwen3-0.6b)")
    add_bench_args(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_bench)

    from nanoqwen.server.run import add_serve_args

    p = sub.add_parser("serve",
                       help="an OpenAI-compatible HTTP server (chat, completions, metrics)")
    add_engine_args(p)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except NanoQwenError as e:
        print(f"nanoqwen: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
