"""The `nanoqwen` command: chat, generate, embed, rerank, init-random, bench, serve."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from nanoqwen.config.pooling import resolve_task
from nanoqwen.entrypoints import benchmark
from nanoqwen.entrypoints.benchmark import add_bench_args
from nanoqwen.entrypoints.chat import chat_loop
from nanoqwen.entrypoints.engine_args import add_engine_args, engine_config_from_args
from nanoqwen.entrypoints.llm import LLM
from nanoqwen.entrypoints.server.run import add_serve_args, serve
from nanoqwen.errors import ConfigError, InvalidRequestError, NanoQwenError
from nanoqwen.lora.peft import read_adapter_config
from nanoqwen.lora.request import LoRARequest
from nanoqwen.model_loader.hub import resolve_model_path
from nanoqwen.model_loader.init_random import PRESETS, write_random_model
from nanoqwen.outputs import RequestOutput, speed_summary
from nanoqwen.pooling_params import PoolingParams

# The default models of `nanoqwen embed` and `nanoqwen rerank` (hub ids; --model overrides).
DEFAULT_EMBEDDING_MODEL = "Qwen/Qwen3-Embedding-0.6B"
DEFAULT_RERANKER_MODEL = "Qwen/Qwen3-Reranker-0.6B"
# Lines handed to the engine per call: far more than a step batches (max_num_seqs), so batching is
# unaffected, while the embeddings of a long input are written as they come, never all held at once.
POOLING_CHUNK = 1024


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults: the model's generation_config.json)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens to generate (default: no limit)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    # DRY, with llama.cpp's flag names (nanoqwen/sample/dry.py)
    g.add_argument("--dry-multiplier", type=float, default=None,
                   help="DRY repetition penalty strength (default 0 = off)")
    g.add_argument("--dry-base", type=float, default=None, help="DRY's growth per repeated token (default 1.75)")
    g.add_argument("--dry-allowed-length", type=int, default=None,
                   help="longest repeat DRY leaves alone (default 2)")
    g.add_argument("--dry-penalty-last-n", type=int, default=None,
                   help="tokens DRY looks back over (default -1 = the whole context, 0 = off)")
    g.add_argument("--dry-sequence-breaker", action="append", default=None, dest="dry_sequence_breakers",
                   metavar="STRING", help="a string no repeat reaches across; repeatable, replaces the defaults "
                                          "('\\n', ':', '\"', '*'); 'none' for none")


def build_llm(args: argparse.Namespace):
    return LLM.from_config(engine_config_from_args(args))


def lora_from_args(args: argparse.Namespace) -> LoRARequest | None:
    """--lora PATH (llama.cpp's flag): the adapter every answer runs with. It turns --enable-lora on and raises
    --max-lora-rank to the adapter's rank where that is larger (call before build_llm)."""
    if args.lora is None:
        return None
    path = Path(args.lora).expanduser()
    config = read_adapter_config(path)  # (an InvalidRequestError naming the problem)
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    args.enable_lora = True
    args.max_lora_rank = max(args.max_lora_rank, *(int(r) for r in ranks))
    return LoRARequest(path.name, 1, str(path))


def sampling_params(llm, args: argparse.Namespace):
    """The model's recommended sampling, with every flag the user gave on top."""
    given = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p", "min_p", "dry_multiplier",
                                                    "dry_base", "dry_allowed_length", "dry_penalty_last_n")
             if getattr(args, name) is not None}
    if args.dry_sequence_breakers is not None:  # (as llama.cpp: "none" clears them)
        given["dry_sequence_breakers"] = [b for b in args.dry_sequence_breakers if b != "none"]
    return replace(llm.get_default_sampling_params(), max_tokens=args.max_tokens, **given)


def cmd_generate(args: argparse.Namespace) -> None:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    lora = lora_from_args(args)
    llm = build_llm(args)
    params = sampling_params(llm, args)
    if not args.no_chat_template:
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=True, enable_thinking=not args.no_think)
    last = None  # the last output carries the metrics
    for delta, last in llm.stream(prompt, params, lora_request=lora):  # noqa: B007
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if last is not None and not args.quiet:  # the speed, on stderr (as llama.cpp's CLI prints it)
        sys.stdout.flush()
        print(speed_line(llm, last), file=sys.stderr)


def speed_line(llm: LLM, output: RequestOutput) -> str:
    """One line: prefill and decode speed, and the weights' format and size (what the engine chose to compute
    with goes to the log: --verbose)."""
    engine, m = llm.llm_engine, output.metrics
    first = m.first_token_time if m.first_token_time is not None else m.arrival_time
    speed = speed_summary(len(output.prompt_token_ids), first - m.arrival_time,
                          len(output.token_ids), (m.last_token_time or first) - first)
    weights = engine.quantization or str(engine.dtype).removeprefix("torch.")
    size = sum(engine.rank_weight_bytes) / 2**30
    spec = ""
    if m.spec_num_drafts:
        accepted = m.spec_num_accepted_tokens / m.spec_num_draft_tokens
        spec = (f" · speculative: {m.spec_mean_acceptance_length:.2f} tokens per step, "
                f"{accepted:.0%} of drafts accepted")
        if m.spec_num_pauses:
            spec += f", paused {m.spec_num_pauses}x for not paying"
    return f"[{speed} · {weights} weights, {size:.2f} GiB{spec}]"


# ------------------------------------------------------------------ embed and rerank

TASK_KINDS = {"generate": "a generative model", "embed": "an embedding model",
              "score": "a reranker"}
TASK_COMMANDS = {"generate": "`nanoqwen generate` or `nanoqwen chat`", "embed": "`nanoqwen embed`",
                 "score": "`nanoqwen rerank`"}
TASK_DEFAULTS = {"embed": DEFAULT_EMBEDDING_MODEL, "score": DEFAULT_RERANKER_MODEL}


def read_input_lines(path: str, what: str) -> list[tuple[int, str]]:
    """(line index from 0, text) of each non-blank line of `path` ("-": stdin), read as UTF-8.

    Only each line's own ending (\\n or \\r\\n) is removed. Blank lines (empty or only whitespace)
    have nothing to embed or score: they are skipped, and every other line keeps its own index, so
    results can be matched back to the input.
    """
    if path == "-" and sys.stdin.isatty():
        print(f"reading {what} from stdin, one per line (Ctrl-D to end)", file=sys.stderr)
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise InvalidRequestError(f"cannot read --input {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8-sig")  # (a byte-order mark, as some editors write, is dropped)
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise InvalidRequestError(f"{'stdin' if path == '-' else path} is not UTF-8 text "
                                  f"(line {line})") from None
    # split("\n"), not splitlines(): the latter also splits at \x0b, \x1c, U+2028..., which would
    # shift the indexes away from the line numbers every other tool shows
    lines = [(i, line.removesuffix("\r")) for i, line in enumerate(text.split("\n"))]
    lines = [(i, line) for i, line in lines if line.strip()]
    if not lines:
        source = "stdin" if path == "-" else path
        raise InvalidRequestError(f"no {what} in {source}: give one per line, on stdin or in "
                                  "--input FILE (blank lines are skipped)")
    return lines


def build_pooling_llm(args: argparse.Namespace, task: str) -> LLM:
    """The LLM of --model for `task` ("embed" or "score").

    With --task auto the checkpoint's files must say it is for that task, checked before any weight
    is loaded (a generative model would otherwise be loaded only to fail); --task embed / score
    uses any Qwen3 checkpoint that way on purpose (as LLM(task=...) does).
    """


    command = TASK_COMMANDS[task]
    if args.task not in ("auto", task):
        raise ConfigError(f"--task {args.task} does not go with {command}: leave --task out, or "
                          f"give --task {task}")
    if args.task == "auto":
        found = resolve_task(resolve_model_path(str(args.model), args.gguf_file), "auto")
        if found != task:
            raise ConfigError(
                f"--model {args.model} is {TASK_KINDS[found]} (read from its files), not "
                f"{TASK_KINDS[task]}: use it with {TASK_COMMANDS[found]}; {command} needs "
                f"{TASK_KINDS[task]} such as {TASK_DEFAULTS[task]} (or pass --task {task} to "
                f"{command.strip('`').split()[1]} with it anyway)")
    return LLM.from_config(replace(engine_config_from_args(args), task=task))


def checked_inputs(lines: list[tuple[int, str]], tokenize: Callable[[str], list[int]]
                   ) -> list[list[int]]:
    """Every line's input ids, tokenised and checked before anything runs, so a bad line (too long
    for the context) stops the command with its line number before any output is written."""
    ids = []
    for index, text in lines:
        try:
            ids.append(tokenize(text))
        except InvalidRequestError as e:
            raise InvalidRequestError(f"input line {index + 1}: {e}") from None
    return ids


def in_chunks(items: list, size: int = POOLING_CHUNK) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start: start + size]


def write_json_line(obj: dict) -> None:
    # compact, ASCII-only JSON: one object a line on any terminal encoding (embeddings are long)
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")


def pooling_summary(llm: LLM, verb: str, count: int, tokens: int, seconds: float) -> str:
    """One stderr line: how many inputs and tokens, the rates, the weights and kernel path."""
    engine = llm.llm_engine
    weights = engine.quantization or str(engine.dtype).removeprefix("torch.")
    size = sum(engine.rank_weight_bytes) / 2**30
    seconds = max(seconds, 1e-9)
    return (f"[{verb} {count} inputs, {tokens} tokens in {seconds:.2f}s · {count / seconds:.1f} "
            f"inputs/s, {tokens / seconds:.0f} tok/s · {weights} weights, {size:.2f} GiB]")


def cmd_embed(args: argparse.Namespace) -> None:
    """One JSON line per non-blank input line, in input order: {"index": i, "embedding": [...]}
    (i: the line's index from 0; the embedding L2-normalised, its first --dimensions values)."""

    if args.dimensions is not None and args.dimensions < 1:  # (fails before loading the model)
        raise InvalidRequestError(f"--dimensions {args.dimensions} must be at least 1")
    params = PoolingParams(dimensions=args.dimensions,
                           truncate_prompt_tokens=args.truncate_prompt_tokens)
    lines = read_input_lines(args.input, "texts")
    llm = build_pooling_llm(args, "embed")
    engine = llm.llm_engine
    prompt = engine.input_processor.sentence_transformers.prompt(args.prompt_name, args.prompt)  # checks the name
    # the prompt goes before each text here; the token ids are then embedded as they are
    ids = checked_inputs(lines, lambda text: engine.input_processor.embedding_input(text, prompt=prompt,
                                                                    params=params))
    start, tokens = time.perf_counter(), 0
    for chunk, chunk_ids in zip(in_chunks(lines), in_chunks(ids), strict=True):
        outputs = llm.embed(chunk_ids, params, use_tqdm=False)  # token ids: tokenised above
        for (index, _), out in zip(chunk, outputs, strict=True):
            write_json_line({"index": index, "embedding": out.outputs.embedding})
            tokens += len(out.prompt_token_ids)
        sys.stdout.flush()
    if not args.quiet:
        print(pooling_summary(llm, "embedded", len(lines), tokens, time.perf_counter() - start),
              file=sys.stderr)


def cmd_rerank(args: argparse.Namespace) -> None:
    """One JSON line per non-blank document line, most relevant first (ties in input order), the
    best --top-n only if given: {"index": i, "score": s, "document": text} (s in [0, 1])."""

    if args.top_n is not None and args.top_n < 1:
        raise InvalidRequestError(f"--top-n {args.top_n} must be at least 1")
    params = PoolingParams(truncate_prompt_tokens=args.truncate_prompt_tokens)
    lines = read_input_lines(args.input, "documents")
    llm = build_pooling_llm(args, "score")
    engine = llm.llm_engine
    # checked up front for the line numbers; llm.score tokenises the same way again (cheap next
    # to the model)
    inputs = checked_inputs(lines, lambda doc: engine.input_processor.score_input(args.query, doc,
                                                                  args.instruction, params))
    start, results = time.perf_counter(), []
    for chunk in in_chunks(lines):
        outputs = llm.score(args.query, [doc for _, doc in chunk], instruction=args.instruction,
                            pooling_params=params, use_tqdm=False)
        results += [(out.outputs.score, index, doc)
                    for (index, doc), out in zip(chunk, outputs, strict=True)]
    seconds = time.perf_counter() - start
    results.sort(key=lambda r: (-r[0], r[1]))  # highest score first, as rerank APIs answer
    for score, index, doc in results[: args.top_n]:
        write_json_line({"index": index, "score": score, "document": doc})
    sys.stdout.flush()
    if not args.quiet:
        tokens = sum(map(len, inputs))
        print(pooling_summary(llm, "scored", len(lines), tokens, seconds), file=sys.stderr)


def add_pooling_input_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--input", "-i", default="-", metavar="FILE",
                   help=f"{what}, one per line, UTF-8 (default: stdin); blank lines are skipped "
                        "and each result's index is its line's index from 0")
    p.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="K",
                   help="keep the last K tokens of a longer input (as vLLM's "
                        "truncate_prompt_tokens) instead of stopping with an error")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no summary line on stderr at the end (inputs, tokens, speed)")


def cmd_chat(args: argparse.Namespace) -> None:
    lora = lora_from_args(args)
    llm = build_llm(args)
    chat_loop(llm, sampling_params(llm, args), enable_thinking=not args.no_think,
              system=args.system, lora_request=lora)


def cmd_init_random(args: argparse.Namespace) -> None:
    out = write_random_model(args.dir, args.preset, dtype=args.dtype, std=args.std, seed=args.seed)
    print(f"wrote a random-weight {args.preset} model to {out}")


def cmd_bench(args: argparse.Namespace) -> None:


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
    serve(args)


def add_lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="a LoRA adapter folder (PEFT's format) to answer with, as llama.cpp's --lora "
                        "(turns --enable-lora on)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoqwen", description="Run Qwen3 models: chat, generate, embed, rerank, serve.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    add_engine_args(p)
    add_verbose_arg(p)
    p.set_defaults(max_num_seqs=1)  # one conversation
    add_sampling_args(p)
    p.add_argument("--no-think", action="store_true",
                   help="start with thinking off (/think turns it on)")
    p.add_argument("--system", default=None, help="system prompt")
    add_lora_arg(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("generate", help="one answer to one prompt, streamed to stdout")
    add_engine_args(p)
    add_verbose_arg(p)
    p.set_defaults(max_num_seqs=1)  # one prompt
    add_sampling_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text, or - to read it from stdin")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--no-think", action="store_true", help="answer without a thinking part")
    add_lora_arg(p)
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no speed line on stderr at the end "
                        "(prefill and decode speed, weights, kernels)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("embed", help="embed texts, one per line, with an embedding model "
                                     "(Qwen3-Embedding): JSON lines out")
    add_engine_args(p)
    add_verbose_arg(p)
    p.set_defaults(model=DEFAULT_EMBEDDING_MODEL)
    add_pooling_input_args(p, "texts to embed")
    p.add_argument("--dimensions", type=int, default=None, metavar="D",
                   help="keep the first D values of each embedding, renormalised "
                        "(Matryoshka; default: all)")
    p.add_argument("--prompt-name", default=None, metavar="NAME",
                   help="put the model's prompt NAME (config_sentence_transformers.json, e.g. "
                        "query) before each text, as sentence-transformers' encode does")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="put TEXT before each text (instead of a named prompt)")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("rerank", help="score documents, one per line, against a query with a "
                                      "reranker (Qwen3-Reranker): JSON lines out, best first")
    add_engine_args(p)
    add_verbose_arg(p)
    p.set_defaults(model=DEFAULT_RERANKER_MODEL)
    add_pooling_input_args(p, "documents to score")
    p.add_argument("--query", required=True, help="the query the documents are scored against")
    p.add_argument("--instruction", default=None,
                   help="the task, in the reranker's prompt (default: web search)")
    p.add_argument("--top-n", type=int, default=None, metavar="N",
                   help="print only the N best documents (default: all)")
    p.set_defaults(func=cmd_rerank)

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


    p = sub.add_parser("serve",
                       help="an OpenAI-compatible HTTP server (chat, completions, metrics)")
    add_engine_args(p)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    return parser


def add_verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", "-v", action="store_true",
                   help="log what the engine chose on stderr: weights in memory, kernels, KV cache size")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):
        logging.basicConfig(level=logging.INFO, format="nanoqwen: %(message)s")
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
