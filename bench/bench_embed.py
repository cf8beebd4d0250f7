"""Embedding throughput, nanoqwen vs sentence-transformers, on one machine, in one run: texts/s and tokens/s
for N texts of random lengths, on the same checkpoint and the same texts.

    python bench/bench_embed.py                    # 256 texts of 32-512 tokens, random Qwen3-Embedding-0.6B, bf16
    python bench/bench_embed.py --dtype float32    # (the faster choice for both on a CPU without native bf16)
    python bench/bench_embed.py --device cuda      # on a GPU
    python bench/bench_embed.py --write            # also record the section in BENCHMARKS.md
    python bench/bench_embed.py --preset embedding-tiny --num-texts 8 --max-tokens 64   # a smoke run, seconds

The checkpoint (default): a random-weight bf16 folder of the exact Qwen3-Embedding-0.6B shape and layout
(`nanoqwen init-random --preset qwen3-embedding-0.6b`, std 0.02), made once in bench/.models/; --model DIR takes
any embedding model folder instead. The texts: N deterministic texts of random words (vocabulary tokens that are a
space and 3-10 letters), each exactly L tokens long as the model's tokenizer makes it (end-of-text token included),
L uniformly random in [--min-tokens, --max-tokens].

Each system runs in its own subprocess (so its peak memory is its own), with the same thread count, and embeds the
texts in one call after a warm-up on the first --warmup-texts; the time is the best of --repeats calls:

- nanoqwen: `LLM(dir, task="embed", dtype=D).embed(texts)` with prefix caching off (the repeats embed the same
  texts, which a prefix cache would serve from memory); continuous batching packs the inputs into steps of up to
  --max-num-batched-tokens tokens.
- sentence-transformers: `SentenceTransformer(dir, device=..., model_kwargs={"dtype": D}).encode(texts,
  batch_size=B)` (B: --st-batch-size, default 32, its own default); encode sorts the texts by length itself, so
  each batch is padded to about its own length. Attention: transformers' default (sdpa).

Both must give the same vectors (the report gives the largest absolute difference and the lowest cosine between
the two systems' embeddings of each text), so the comparison is of the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (bench/ is not a package: its machine line and BENCHMARKS.md writer)

MODELS_DIR = bench_model.ROOT / "bench" / ".models"
DEFAULT_PRESET = "qwen3-embedding-0.6b"
SYSTEMS = ("nanoqwen", "sentence-transformers")
# a vocabulary token that is a space (BPE's "Ġ") and a short lower-case word: one token in running text
WORD_TOKEN = re.compile(r"Ġ([a-z]{3,10})")


# ------------------------------------------------------------------ checkpoint and texts


def checkpoint_dir(preset: str) -> Path:
    return MODELS_DIR / f"{preset}-random-bf16"


def ensure_checkpoint(preset: str) -> Path:
    """The preset's random-weight bf16 checkpoint (std 0.02), written on first use."""
    from nanoqwen.entrypoints import benchmark

    path = checkpoint_dir(preset)
    if not (path / "config.json").exists():
        print(f"writing a random {preset} checkpoint to {path} ...", file=sys.stderr)
    return benchmark.ensure_random_checkpoint(path, preset)  # (written whole, then renamed into place)


def vocabulary_words(tokenizer) -> list[str]:
    """The vocabulary's " word" tokens (e.g. " house"), in id order: deterministic for a tokenizer."""
    words = []
    for token_id in range(tokenizer.vocab_size):
        m = WORD_TOKEN.fullmatch(tokenizer.id_to_token(token_id) or "")
        if m:
            words.append(" " + m[1])
    return words


def text_of_length(tokenizer, words: list[str], length: int, rng: random.Random) -> str:
    """Random words whose embedding input (the tokenizer's appended end-of-text token included) is exactly
    `length` tokens. Each word is about one token, so starting from length - 1 words needs few corrections."""
    chosen = [rng.choice(words) for _ in range(length - 1)]
    for _ in range(100):
        text = "".join(chosen).lstrip()
        n = len(tokenizer.encode(text, add_special_tokens=True))
        if n == length:
            return text
        if n > length:
            del chosen[max(1, len(chosen) - (n - length)):]  # each word is at least one token
        else:
            chosen += [rng.choice(words) for _ in range(length - n)]
    raise RuntimeError(f"could not make a text of exactly {length} tokens")


def make_texts(model_dir: Path, num: int, min_tokens: int, max_tokens: int, seed: int) -> tuple[list[str], int]:
    """num texts with lengths uniform in [min_tokens, max_tokens] tokens, and their total token count."""
    from nanoqwen.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    words, rng = vocabulary_words(tokenizer), random.Random(seed)
    lengths = [rng.randint(min_tokens, max_tokens) for _ in range(num)]
    return [text_of_length(tokenizer, words, n, rng) for n in lengths], sum(lengths)


# ------------------------------------------------------------------ the two systems (each in its own process)


def timed_runs(embed: Callable[[list[str]], Any], texts: list[str], warmup: int, repeats: int,
               sync: Callable[[], None]) -> tuple[list[float], Any]:
    """Warm up on the first `warmup` texts, then embed all of them `repeats` times: (seconds of each, last result)."""
    embed(texts[:warmup])
    sync()
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = embed(texts)
        sync()
        times.append(time.perf_counter() - start)
    return times, result


def run_nanoqwen(model_dir: str, texts: list[str], args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    import torch

    from nanoqwen import LLM

    start = time.perf_counter()
    llm = LLM(model_dir, task="embed", dtype=args.dtype, device=args.device, enable_prefix_caching=False,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    load = time.perf_counter() - start
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times, outputs = timed_runs(lambda ts: llm.embed(ts, use_tqdm=False), texts, args.warmup_texts,
                                args.repeats, sync)
    vectors = torch.tensor([o.outputs.embedding for o in outputs])  # [N, H] float32, normalised
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"times": times, "tokens": tokens, "load_s": load, "kernel_path": llm.llm_engine.kernel_path}, vectors


def run_sentence_transformers(model_dir: str, texts: list[str], args: argparse.Namespace
                              ) -> tuple[dict[str, Any], Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    start = time.perf_counter()
    model = SentenceTransformer(model_dir, device=args.device, local_files_only=True,
                                model_kwargs={"dtype": getattr(torch, args.st_dtype or args.dtype)})
    load = time.perf_counter() - start
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def embed(batch: list[str]):
        with torch.inference_mode():
            return model.encode(batch, batch_size=args.st_batch_size, convert_to_tensor=True,
                                show_progress_bar=False)

    times, vectors = timed_runs(embed, texts, args.warmup_texts, args.repeats, sync)
    tokens = sum(map(len, model.tokenizer(texts)["input_ids"]))  # its own tokenisation, to check it is the same
    return {"times": times, "tokens": tokens, "load_s": load}, vectors.float().cpu()


def child(system: str, args: argparse.Namespace) -> None:
    """Run one system; its figures on stdout (RESULT {...}), its embeddings [N, H] to --out."""
    import torch

    torch.set_num_threads(args.threads)
    texts = json.loads(Path(args.texts_file).read_text(encoding="utf-8"))
    run = run_nanoqwen if system == "nanoqwen" else run_sentence_transformers
    result, vectors = run(args.model, texts, args)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.device == "cuda":
        result["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
    torch.save(vectors, args.out)
    print("RESULT " + json.dumps(result))


def run_child(system: str, model_dir: Path, texts_file: Path, out: Path, threads: int) -> dict[str, Any]:
    """This script again, as one system's subprocess, with this run's flags (later ones win over earlier)."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", system, "--model", str(model_dir),
           "--texts-file", str(texts_file), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{system} benchmark failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


# ------------------------------------------------------------------ report


def agreement(a, b) -> tuple[float, float]:
    """(largest |a - b|, lowest cosine of a row of a with the same row of b) of two [N, H] embedding sets."""
    import torch.nn.functional as F

    return float((a - b).abs().max()), float(F.cosine_similarity(a, b, dim=1).min())


def table(results: dict[str, dict[str, Any]], num_texts: int) -> str:
    ours, theirs = results["nanoqwen"], results["sentence-transformers"]
    for r in (ours, theirs):
        r["seconds"] = min(r["times"])
        r["texts_s"], r["tok_s"] = num_texts / r["seconds"], r["tokens"] / r["seconds"]
    rows = [  # (label, key, format, higher is better: the ratio is shown)
        ("Texts/s", "texts_s", ".2f", True),
        ("Tokens/s", "tok_s", ".0f", True),
        ("Time (s, best of the repeats)", "seconds", ".2f", False),
        ("Load time (s)", "load_s", ".1f", False),
        ("Peak memory (process max RSS, GiB)", "peak_rss_gib", ".2f", False),
        ("Peak GPU memory (torch max allocated, GiB)", "peak_cuda_gib", ".2f", False),
    ]
    lines = ["| | nanoqwen | sentence-transformers | nanoqwen / sentence-transformers |", "|---|---:|---:|---:|"]
    for label, key, fmt, ratio in rows:
        if key in ours and key in theirs:
            shown = f"{ours[key] / theirs[key]:.2f}×" if ratio or "peak" in key else ""
            lines.append(f"| {label} | {ours[key]:{fmt}} | {theirs[key]:{fmt}} | {shown} |")
    return "\n".join(lines)


def report(args: argparse.Namespace, model_name: str, results: dict[str, dict[str, Any]], total_tokens: int,
           diff: float, cosine: float, dims: int) -> str:
    import sentence_transformers

    st_dtype = args.st_dtype or args.dtype
    command = bench_model.command_line("bench_embed.py", sys.argv[1:])
    return (f"### Embedding throughput: {args.num_texts} texts of {args.min_tokens}–{args.max_tokens} tokens "
            f"({args.device}, {args.dtype})\n\n"
            f"`{command}` on {model_name}: {args.num_texts} texts of random words "
            f"({total_tokens:,} tokens in all, lengths uniformly random, seed {args.seed}), the same for both, "
            f"{args.threads} torch thread{'s' * (args.threads > 1)} each, best of {args.repeats} after a warm-up on "
            f"{min(args.warmup_texts, args.num_texts)} texts. "
            f"nanoqwen: one `LLM.embed` call, prefix caching off, up to {args.max_num_seqs} sequences and "
            f"{args.max_num_batched_tokens} tokens a step. sentence-transformers "
            f"{sentence_transformers.__version__}: `encode` with batch_size {args.st_batch_size} "
            f"(sorted by length, its default), {st_dtype}, sdpa attention.\n\n"
            f"{bench_model.machine_line(args.device)}\n\n"
            + table(results, args.num_texts)
            + f"\n\nSame vectors: over the {args.num_texts} texts ({dims} dimensions, normalised) the largest "
              f"absolute difference between the two systems' embeddings is {diff:.2e} and the lowest cosine "
              f"{cosine:.6f}.")


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an embedding model folder (default: the --preset's random one)")
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=["qwen3-embedding-0.6b", "embedding-tiny"],
                   help="the random checkpoint's shape, made once in bench/.models/ (without --model)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="both systems' dtype (float32: often the faster choice on a CPU without native bf16)")
    p.add_argument("--st-dtype", default=None, choices=["bfloat16", "float32"],
                   help="sentence-transformers' dtype, if not --dtype")
    p.add_argument("--num-texts", type=int, default=256)
    p.add_argument("--min-tokens", type=int, default=32, help="shortest text, in tokens (end-of-text included)")
    p.add_argument("--max-tokens", type=int, default=512, help="longest text, in tokens")
    p.add_argument("--seed", type=int, default=0, help="the texts' seed")
    p.add_argument("--repeats", type=int, default=2, help="best of N timed calls")
    p.add_argument("--warmup-texts", type=int, default=16,
                   help="how many of the texts (the first) are embedded once before timing")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, both systems")
    p.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    p.add_argument("--max-num-seqs", type=int, default=64, help="nanoqwen: most sequences a step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="nanoqwen: most tokens a step")
    p.add_argument("--write", action="store_true", help="record the section in BENCHMARKS.md")
    for hidden in ("--child", "--texts-file", "--out"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 2 <= args.min_tokens <= args.max_tokens:
        p.error("need 2 <= --min-tokens <= --max-tokens (a text is at least one word and the end-of-text token)")
    for name in ("num_texts", "repeats", "threads", "st_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main() -> None:
    import torch

    args = parse_args()
    if args.child:
        return child(args.child, args)
    model_dir = Path(args.model) if args.model else ensure_checkpoint(args.preset)
    model_name = model_dir.name if args.model else f"a random checkpoint of the {args.preset} shape"
    texts, total_tokens = make_texts(model_dir, args.num_texts, args.min_tokens, args.max_tokens, args.seed)
    results, vectors = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        texts_file = Path(tmp) / "texts.json"
        texts_file.write_text(json.dumps(texts), encoding="utf-8")
        for system in SYSTEMS:
            print(f"running {system} ({len(texts)} texts, {total_tokens:,} tokens) ...", file=sys.stderr)
            out = Path(tmp) / f"{system}.pt"
            results[system] = r = run_child(system, model_dir, texts_file, out, args.threads)
            print(f"{system}: {len(texts) / min(r['times']):.2f} texts/s, times {[round(t, 3) for t in r['times']]}",
                  file=sys.stderr, flush=True)
            vectors[system] = torch.load(out)
    ours, theirs = (results[s]["tokens"] for s in SYSTEMS)
    if ours != theirs or ours != total_tokens:
        sys.exit(f"the systems tokenised the texts differently: nanoqwen {ours}, sentence-transformers {theirs}, "
                 f"made for {total_tokens} tokens")
    diff, cosine = agreement(vectors["nanoqwen"], vectors["sentence-transformers"])
    body = report(args, model_name, results, total_tokens, diff, cosine, vectors["nanoqwen"].shape[1])
    print(body)
    if args.write:  # one section per device and CPU class, as the other scripts; a --model gets its own
        section = bench_model.section_name("bench_embed", args.device)
        bench_model.write_benchmarks(section + (f"-{model_dir.name}" if args.model else ""), body)


if __name__ == "__main__":
    main()
