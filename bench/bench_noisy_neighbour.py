"""A noisy neighbour on `nanoqwen serve`: how long another client waits for its first token while the worst
request the server's limits allow runs beside it.

    python bench/bench_noisy_neighbour.py            # a tiny random checkpoint: the engine's own per-token work
    python bench/bench_noisy_neighbour.py --write    # also record the table in BENCHMARKS.md
    python bench/bench_noisy_neighbour.py --model DIR --max-num-seqs 256

The server runs in its own process. The victim: a 4-token greedy completion of a short prompt, streamed; its time
to first token (request sent -> first text chunk) is measured --trials times on the idle server, then as many
times beside each hostile request. Both hostile requests ask for n=128 answers (the most a request may ask),
max_tokens 60, ignore_eos, the most stop strings the server takes (--max-stop-sequences, each of the longest
length allowed, and never matched) and the most stop token ids (--max-stop-token-ids, none of them in the
answer): "greedy" takes the argmax; "sampled" asks for the costliest sampling there is: temperature 1, top_p 0.9
and no top_k (on a random checkpoint's flat distribution most of the vocabulary stays), min_p, the three
penalties and the most logprobs (MAX_LOGPROBS). The server's max_num_seqs is above n, so the victim is admitted at
once: what it waits on is the hostile request's steps. Reported: the victim's median and p90 time to first
token, idle and beside each hostile request, their ratio, and the hostile request's own time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_model  # noqa: E402  (bench/ is not a package)
from bench_serving import start_server  # noqa: E402

from nanoqwen import LLM, SamplingParams  # noqa: E402
from nanoqwen.config import EngineConfig  # noqa: E402
from nanoqwen.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_LENGTH  # noqa: E402

DEFAULT_DIR = bench_model.ROOT / "bench" / ".models" / "tiny-random"


def first_token_seconds(base: str, body: dict) -> float:
    """Seconds from sending a streamed completion to its first text chunk (the rest is read and dropped)."""
    start, first = time.perf_counter(), None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    return first


SAMPLED = {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "min_p": 0.01, "presence_penalty": 1.0,
           "frequency_penalty": 1.0, "repetition_penalty": 1.2, "logprobs": MAX_LOGPROBS}


def hostile_body(args: argparse.Namespace) -> dict:
    """The worst greedy request the limits allow: most answers, most and longest stop strings, most stop ids (none
    of them in the greedy answer, made here first, so that every answer runs all 60 steps)."""
    prompt, steps = "Tell me everything.", 60
    llm = LLM(str(args.model), dtype=args.dtype, max_model_len=256, enforce_eager=True)
    made = set(llm.generate(prompt, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                            use_tqdm=False)[0].token_ids)
    del llm
    stop_ids = [t for t in range(1000, 1000 + args.max_stop_token_ids + len(made)) if t not in made]
    stops = [chr(0x4E00 + i) * MAX_STOP_STRING_LENGTH for i in range(args.max_stop_sequences)]  # never written
    return {"prompt": prompt, "n": MAX_N, "max_tokens": steps, "ignore_eos": True, "temperature": 0,
            "stop": stops, "stop_token_ids": stop_ids[: args.max_stop_token_ids]}


def measure(args: argparse.Namespace, base: str) -> dict:
    victim = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    for _ in range(3):  # warm-up
        first_token_seconds(base, victim)
    greedy = hostile_body(args)
    # (its stop ids may hold tokens a sampled answer writes: an answer that ends early only makes it lighter)
    hostile = {"greedy": greedy, "sampled": {**greedy, **SAMPLED}}
    result = {"idle": [first_token_seconds(base, victim) for _ in range(args.trials)]}
    for name in args.hostile:
        result[name] = beside(args, base, victim, hostile[name])
    return result


def beside(args: argparse.Namespace, base: str, victim: dict, hostile: dict) -> dict:
    """The victim's times to first token while `hostile` runs (sent again as often as the trials need)."""
    busy, hostile_seconds = [], []

    def run_hostile() -> None:
        start = time.perf_counter()
        r = httpx.post(f"{base}/v1/completions", json=hostile, timeout=3600)
        r.raise_for_status()
        hostile_seconds.append(time.perf_counter() - start)

    while len(busy) < args.trials:
        thread = threading.Thread(target=run_hostile)
        thread.start()
        time.sleep(args.head_start)  # (its prompt in, its answers decoding)
        while thread.is_alive() and len(busy) < args.trials:
            busy.append(first_token_seconds(base, victim))
        thread.join()
    return {"busy": busy, "hostile": hostile_seconds}


def quantile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def report(args: argparse.Namespace, r: dict) -> str:
    idle = statistics.median(r["idle"])
    lines = [
        "### A noisy neighbour: another client's time to first token beside the worst requests allowed",
        "",
        f"`{bench_model.command_line('bench_noisy_neighbour.py', sys.argv[1:])}` on {args.model.name} "
        f"({args.dtype}; the server's max_num_seqs {args.max_num_seqs}, --max-seqs-per-request-step "
        f"{args.max_seqs_per_request_step}, --max-stop-sequences "
        f"{args.max_stop_sequences}, --max-stop-token-ids {args.max_stop_token_ids}). Each hostile request: n "
        f"{MAX_N}, max_tokens 60, {args.max_stop_sequences} stop strings of {MAX_STOP_STRING_LENGTH} characters, "
        f"{args.max_stop_token_ids} stop token ids; greedy, or sampled with "
        f"{', '.join(f'{k} {v}' for k, v in SAMPLED.items())}. The victim: a 4-token greedy completion, streamed.",
        "",
        bench_model.machine_line("cpu"),
        "",
        "| victim's time to first token | median (ms) | p90 (ms) | trials | against idle "
        "| the hostile request took (s) |",
        "|---|---:|---:|---:|---:|---|",
        f"| idle server | {1e3 * idle:.1f} | {1e3 * quantile(r['idle'], 0.9):.1f} | {len(r['idle'])} | | |",
    ]
    for name in args.hostile:
        busy = r[name]["busy"]
        lines.append(f"| beside the {name} hostile request | {1e3 * statistics.median(busy):.1f} | "
                     f"{1e3 * quantile(busy, 0.9):.1f} | {len(busy)} | **{statistics.median(busy) / idle:.2f}×** | "
                     f"{', '.join(f'{s:.1f}' for s in r[name]['hostile'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help=f"model folder (default: {DEFAULT_DIR})")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-seqs-per-request-step", type=int, default=EngineConfig.max_seqs_per_request_step)
    parser.add_argument("--max-stop-sequences", type=int, default=64)
    parser.add_argument("--max-stop-token-ids", type=int, default=1024)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--head-start", type=float, default=0.5,
                        help="seconds the hostile request runs before the victim's trials start")
    parser.add_argument("--hostile", nargs="+", choices=["greedy", "sampled"], default=["greedy", "sampled"])
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    args = parser.parse_args()
    if args.model is None:
        args.model = DEFAULT_DIR
        if not (args.model / "config.json").exists():
            from nanoqwen.model_loader.init_random import write_random_model

            write_random_model(args.model, "tiny", dtype="bfloat16")
    proc, base = start_server(
        args.model, "--dtype", args.dtype, "--max-model-len", "256", "--max-num-seqs", str(args.max_num_seqs),
        "--max-seqs-per-request-step", str(args.max_seqs_per_request_step), "--max-stop-sequences",
        str(args.max_stop_sequences), "--max-stop-token-ids", str(args.max_stop_token_ids), "--log-level", "warning")
    try:
        text = report(args, measure(args, base))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(text)
    if args.write:
        bench_model.write_benchmarks(bench_model.section_name("bench_noisy_neighbour", "cpu"), text)


if __name__ == "__main__":
    main()
