"""Speculative decoding on CPU: batch-1 greedy decode of a bf16 target with and without drafts
(the target's own weights quantised to int8 / int4, or n-gram prompt lookup), and where it stops
paying as the batch grows.

    python bench/bench_spec.py                  # random checkpoint with the exact Qwen3-0.6B shape
    python bench/bench_spec.py --write          # also record the tables in BENCHMARKS.md
    python bench/bench_spec.py --quick --new-tokens 16    # a smoke run: few configs, short answers
    python bench/bench_spec.py --ks 2 4 --batches 1 4     # other draft lengths and batch sizes

The checkpoint has the exact Qwen3-0.6B shape with random weights of std --std (default 0.2, not
bench_model.py's 0.02): at 0.02 (and still at 0.08) the logits are nearly flat, exact bf16 ties
between the top two tokens are common, and greedy equality hinges on the order of float32
additions; at 0.2 the top token's probability is 0.4-0.9, as in trained checkpoints. How often the int8 /
int4 copy's greedy token equals the bf16 model's depends on that scale: the std of one of its
matrices is printed with the tables.
Each configuration runs in its own subprocess (its memory and torch.compile caches are its own)
with 2 torch threads, greedy, EOS ignored, the same token ids: one warm-up generate, then the best
of 2. Decode tok/s is the tokens after the first over last_token_time - first_token_time (the
draft model's catching up on the prompt falls inside it); at batch > 1, all sequences' tokens
after their first over the span from the earliest first token to the latest last one.
Speculative greedy decoding must give the plain bf16 tokens exactly: a difference prints MISMATCH.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (bench/ is not a package: its checkpoint, machine line, writer)

THREADS, REPEATS, PROMPT_LEN = 2, 2, 32
KS, BATCHES, QUANTS = (1, 2, 3, 4, 6), (1, 2, 4, 8), ("int8", "int4")
QUICK_KS, QUICK_BATCHES, QUICK_QUANTS = (4,), (1, 2), ("int4",)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
# speculation in every step whatever the batch and whatever it pays (the "switch on" rows keep
# the defaults: off above batch 2, drafts that do not pay paused)
FORCE_ON = 1024
ALWAYS = {"disable_by_batch_size": FORCE_ON, "disable_by_acceptance": False}


def prompt(kind: str) -> list[int]:
    """"ordinary": bench_model's batch prompt (distinct tokens); "repeated": an 8-token sequence
    four times over, which a model (a random one especially) tends to go on repeating."""
    if kind == "ordinary":
        return bench_model.prompts(1, PROMPT_LEN)[0]
    return [1000 + 613 * i for i in range(8)] * (PROMPT_LEN // 8)


def batch_prompts(kind: str, batch: int) -> list[list[int]]:
    """batch 1: prompt(kind); larger ordinary batches: bench_model's distinct prompts (row 0 is
    the batch-1 prompt)."""
    if batch == 1 or kind != "ordinary":
        return [prompt(kind)] * batch
    return bench_model.prompts(batch, PROMPT_LEN)


# ------------------------------------------------------------------ one configuration (child)


def measure(llm, kind: str, batch: int, new_tokens: int, gaps: bool = False) -> dict:
    """Best of REPEATS generates after a warm-up: decode tok/s (all sequences), the tokens, and
    the speculation counters summed over the sequences (of the best run; greedy: every run
    alike). gaps: also each token's top-2 logprob gap (for the reference, plain bf16)."""
    from nanoqwen import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ps = batch_prompts(kind, batch)
    llm.generate(ps, params, use_tqdm=False)  # warm-up (torch.compile, the draft's shapes)
    runs = []
    for _ in range(REPEATS):
        outs = llm.generate(ps, params, use_tqdm=False)
        ms = [o.metrics for o in outs]
        span = max(m.last_token_time for m in ms) - min(m.first_token_time for m in ms)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        runs.append({"tok_s": sum(len(t) - 1 for t in tokens) / span, "tokens": tokens,
                     "drafts": sum(m.spec_num_drafts for m in ms),
                     "draft_tokens": sum(m.spec_num_draft_tokens for m in ms),
                     "accepted": sum(m.spec_num_accepted_tokens for m in ms),
                     "pauses": sum(m.spec_num_pauses for m in ms)})
    best = max(runs, key=lambda r: r["tok_s"])
    # two greedy runs of the same prompts that disagree with each other
    best["unsteady"] = any(r["tokens"] != best["tokens"] for r in runs)
    if gaps:  # untimed: how far each greedy token's logprob is above the runner-up's
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=new_tokens,
                                               ignore_eos=True, logprobs=2), use_tqdm=False)
        best["gaps"] = [[top2_gap(lp) for lp in o.outputs[0].logprobs] for o in outs]
    return best


def top2_gap(logprobs: dict) -> float:
    first, second = sorted((v.logprob for v in logprobs.values()), reverse=True)[:2]
    return first - second


def child(spec: dict, model_dir: str, new_tokens: int) -> None:
    """spec: {"quantization": None|"int8"|"int4", "speculative_config": dict|None,
    "runs": [[prompt kind, batch], ...]}."""
    import torch

    torch.set_num_threads(THREADS)
    from nanoqwen import LLM

    runs = [tuple(r) for r in spec["runs"]]
    k = (spec["speculative_config"] or {}).get("num_speculative_tokens", 0)
    llm = LLM(model_dir, dtype="bfloat16", device="cpu", quantization=spec["quantization"],
              speculative_config=spec["speculative_config"], enable_prefix_caching=False,
              max_model_len=PROMPT_LEN + new_tokens + k + 16,
              max_num_seqs=max(b for _, b in runs), kv_cache_memory=1 << 30)
    reference = spec["quantization"] is None and spec["speculative_config"] is None
    results = {f"{kind}-b{batch}": measure(llm, kind, batch, new_tokens, reference)
               for kind, batch in runs}
    print("RESULT " + json.dumps({"runs": results}))


def run_child(name: str, spec: dict, model_dir: Path, new_tokens: int) -> dict | None:
    """One configuration in its own process; None (and its error on stderr) if it failed."""
    print(f"running {name} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, __file__, "--child", json.dumps(spec), "--model", str(model_dir),
           "--new-tokens", str(new_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(f"{name} FAILED (exit {proc.returncode}):\n{proc.stderr[-4000:]}", file=sys.stderr)
        return None
    result = json.loads(line[len("RESULT "):])
    for key, r in result["runs"].items():
        print(f"  {key}: {r['tok_s']:.2f} tok/s, drafts {r['drafts']}, proposed "
              f"{r['draft_tokens']}, accepted {r['accepted']}, paused {r['pauses']}",
              file=sys.stderr, flush=True)
    return result["runs"]


# ------------------------------------------------------------------ report


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, int] | None:
    """None if the sequences equal the reference's token for token, else (which sequence, the
    length of its common start with the reference's) of the first that differs."""
    for s, (a, b) in enumerate(zip(tokens, reference, strict=True)):
        if a != b:
            return s, next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                           min(len(a), len(b)))
    return None


def spec_cells(r: dict) -> tuple[str, str]:
    """(acceptance rate, mean acceptance length) of a run's counters; with the times drafts were
    paused for not paying, if any."""
    if not r["draft_tokens"]:
        return "no drafts", "—"
    paused = f" ({r['pauses']} pauses)" if r.get("pauses") else ""
    return (f"{r['accepted'] / r['draft_tokens']:.0%}",
            f"{1 + r['accepted'] / r['drafts']:.2f}{paused}")


class Report:
    def __init__(self) -> None:
        self.mismatches: list[str] = []

    def same(self, name: str, r: dict, ref: dict, must: bool) -> str:
        """The 'same tokens as bf16' cell; a speculative run that differs is a MISMATCH."""
        found = agreement(r["tokens"], ref["tokens"])
        unsteady = " (runs differed)" if r.get("unsteady") else ""
        if found is None:
            return "yes" + unsteady
        s, at = found
        if not must:
            return f"no (first {at} agree){unsteady}"
        gaps = ref.get("gaps")
        gap = (f"; there plain bf16's greedy token leads the runner-up by "
               f"{gaps[s][at]:.4f} in logprob" if gaps and at < len(gaps[s]) else "")
        where = f"sequence {s}, token {at}" if len(r["tokens"]) > 1 else f"token {at}"
        self.mismatches.append(f"MISMATCH: {name}: greedy tokens differ from plain bf16's from "
                               f"{where}{gap}{unsteady}")
        return f"**MISMATCH** (from token {at}){unsteady}"


def first_table(results: dict, ks: list[int], quants: list[str], report: Report) -> list[str]:
    """Rows of speculation in every step, then the defaults' rows ("switch on"): the largest k
    with drafts that do not pay paused."""
    lines = ["| configuration | prompt | decode tok/s | vs plain bf16 | acceptance rate | "
             "mean acceptance length | same tokens as bf16 |", "|---|---|---:|---:|---:|---:|---|"]
    base = results.get("bf16") or {}
    rows = [("plain bf16", "bf16", "ordinary", False), ("plain bf16", "bf16", "repeated", False)]
    rows += [(f"plain {q} (reference, no speculation)", q, "ordinary", False) for q in quants]
    rows += [(f"self_quantized {q}, k={k}", f"sq-{q}-k{k}", kind, True)
             for kind in ("ordinary", "repeated") for q in quants for k in ks]
    ngram = (f"ngram k={NGRAM['num_speculative_tokens']}, lookup "
             f"{NGRAM['prompt_lookup_min']}..{NGRAM['prompt_lookup_max']}")
    rows += [(ngram, "ngram", kind, True) for kind in ("ordinary", "repeated")]
    rows += [(f"self_quantized {q}, k={max(ks)}, switch on", f"sq-{q}-k{max(ks)}-switch", kind,
              True) for kind in ("ordinary", "repeated") for q in quants]
    rows += [(f"{ngram}, switch on", "ngram-switch", kind, True)
             for kind in ("ordinary", "repeated")]
    for label, name, kind, speculative in rows:
        key, ref = f"{kind}-b1", base.get(f"{kind}-b1")
        r = (results.get(name) or {}).get(key)
        if r is None:
            lines.append(f"| {label} | {kind} | failed | | | | |")
            continue
        ratio = f"{r['tok_s'] / ref['tok_s']:.2f}×" if ref else ""
        rate, length = spec_cells(r) if speculative else ("", "")
        same = "(the reference)" if name == "bf16" else (
            report.same(f"{label}, {kind} prompt", r, ref, speculative) if ref else "")
        lines.append(f"| {label} | {kind} | {r['tok_s']:.2f} | {ratio} | {rate} | {length} | "
                     f"{same} |")
    return lines


def best_config(results: dict, ks: list[int], quants: list[str]) -> tuple[str, dict] | None:
    """The self_quantized configuration of the highest batch-1 decode rate (among those that give
    bf16's tokens, if any does)."""
    ref = (results.get("bf16") or {}).get("ordinary-b1")
    found = [(f"sq-{q}-k{k}", q, k) for q in quants for k in ks
             if (results.get(f"sq-{q}-k{k}") or {}).get("ordinary-b1")]
    if not found:
        return None
    exact = [c for c in found if ref is None
             or agreement(results[c[0]]["ordinary-b1"]["tokens"], ref["tokens"]) is None]
    name, q, k = max(exact or found, key=lambda c: results[c[0]]["ordinary-b1"]["tok_s"])
    return name, {"method": "self_quantized", "quantization": q, "num_speculative_tokens": k,
                  **ALWAYS}


def batch_table(results: dict, label: str, batches: list[int], report: Report) -> list[str]:
    lines = [f"| batch | plain bf16 tok/s (all sequences) | {label} tok/s | ratio | "
             "acceptance rate | mean acceptance length | same tokens as bf16 |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for b in batches:
        ref = (results.get("bf16") or {}).get(f"ordinary-b{b}")
        r = (results.get("best") or {}).get(f"ordinary-b{b}")
        if ref is None or r is None:
            cells = [f"{x['tok_s']:.2f}" if x else "failed" for x in (ref, r)]
            lines.append(f"| {b} | {cells[0]} | {cells[1]} | | | | |")
            continue
        rate, length = spec_cells(r)
        same = report.same(f"{label}, batch {b}", r, ref, True)
        lines.append(f"| {b} | {ref['tok_s']:.2f} | {r['tok_s']:.2f} | "
                     f"{r['tok_s'] / ref['tok_s']:.2f}× | {rate} | {length} | {same} |")
    return lines


def write_checkpoint(model_dir: Path, std: float, embedding_scale: float) -> None:
    """A random Qwen3-0.6B-shaped checkpoint, its embedding multiplied by embedding_scale."""
    from safetensors.torch import load_file, save_file

    from nanoqwen.model_loader.init_random import write_random_model

    print(f"writing a random Qwen3-0.6B-shaped checkpoint (std {std:g}, embedding x"
          f"{embedding_scale:g}) to {model_dir}", file=sys.stderr)
    write_random_model(model_dir, "qwen3-0.6b", dtype="bfloat16", std=std)
    if embedding_scale != 1:
        path = model_dir / "model.safetensors"
        tensors = load_file(path)
        name = "model.embed_tokens.weight"
        tensors[name] = (tensors[name].float() * embedding_scale).bfloat16()
        save_file(tensors, path, metadata={"format": "pt"})


def weight_std(model_dir: Path) -> str:
    """The std of layer 0's down projection, read from the checkpoint (bench_model writes
    N(0, 0.02) weights)."""
    from safetensors import safe_open

    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            name = next((n for n in f.keys() if n.endswith("layers.0.mlp.down_proj.weight")), None)
            if name is not None:
                return f"{f.get_tensor(name).float().std().item():.4f}"
    return "unknown"


def distinct(r: dict | None) -> str:
    return f"{len(set(r['tokens'][0]))} distinct" if r else "failed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="model folder (default: a random one of the Qwen3-0.6B shape, "
                             "see --std)")
    parser.add_argument("--std", type=float, default=0.2,
                        help="std of the random checkpoint's weights (default 0.2; written once "
                             "under bench/.models)")
    parser.add_argument("--embedding-scale", type=float, default=1.0,
                        help="multiply the random checkpoint's embedding by this (BENCHMARKS.md's "
                             "checkpoint whose drafts are always right: --std 0.02 "
                             "--embedding-scale 10; each token then predicts itself)")
    parser.add_argument("--write", action="store_true", help="record the tables in BENCHMARKS.md")
    parser.add_argument("--ks", type=int, nargs="+", default=None,
                        help=f"self_quantized draft lengths (default: {' '.join(map(str, KS))}; "
                             f"--quick: {' '.join(map(str, QUICK_KS))})")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="batch sizes of the batch table (default: "
                             f"{' '.join(map(str, BATCHES))}; --quick: "
                             f"{' '.join(map(str, QUICK_BATCHES))})")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: self_quantized {'/'.join(QUICK_QUANTS)} only, the "
                             "--quick draft lengths and batch sizes")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode is timed after the first token)")
    if args.child:
        return child(json.loads(args.child), args.model, args.new_tokens)
    ks = sorted(set(args.ks or (QUICK_KS if args.quick else KS)))
    batches = sorted(set(args.batches or (QUICK_BATCHES if args.quick else BATCHES)))
    quants = list(QUICK_QUANTS if args.quick else QUANTS)
    if min(ks + batches) < 1:
        parser.error("--ks and --batches must be at least 1")
    scaled = f"-embed{args.embedding_scale:g}" if args.embedding_scale != 1 else ""
    model_dir = Path(args.model) if args.model else (
        bench_model.DEFAULT_DIR.parent / f"qwen3-0.6b-random-bf16-std{args.std:g}{scaled}")
    if args.model is None and not (model_dir / "config.json").exists():
        write_checkpoint(model_dir, args.std, args.embedding_scale)

    std = weight_std(model_dir)
    print(f"{bench_model.machine_line('cpu')}\n{THREADS} torch threads in each configuration's "
          f"process; weights' std {std} (layer 0's down projection)", file=sys.stderr, flush=True)
    b1 = [["ordinary", 1]]
    configs = {"bf16": (None, None, [["ordinary", b] for b in batches] + [["repeated", 1]])}
    configs.update({q: (q, None, b1) for q in quants})
    configs.update({f"sq-{q}-k{k}": (None, {"method": "self_quantized", "quantization": q,
                                            "num_speculative_tokens": k, **ALWAYS},
                                        b1 + [["repeated", 1]])
                    for q in quants for k in ks})
    configs["ngram"] = (None, {**NGRAM, **ALWAYS}, b1 + [["repeated", 1]])
    configs.update({f"sq-{q}-k{max(ks)}-switch": (None, {"method": "self_quantized",
                                                         "quantization": q,
                                                         "num_speculative_tokens": max(ks)},
                                                  b1 + [["repeated", 1]]) for q in quants})
    configs["ngram-switch"] = (None, NGRAM, b1 + [["repeated", 1]])
    results = {}
    for name, (quantization, spec, runs) in configs.items():
        results[name] = run_child(name, {"quantization": quantization, "speculative_config": spec,
                                         "runs": runs}, model_dir, args.new_tokens)
    best = best_config(results, ks, quants)
    if best is not None:
        best_name, best_spec = best
        results["best"] = run_child(f"{best_name} at batches {batches}",
                                    {"quantization": None, "speculative_config": best_spec,
                                     "runs": [["ordinary", b] for b in batches]},
                                    model_dir, args.new_tokens)
        best_label = (f"self_quantized {best_spec['quantization']}, "
                      f"k={best_spec['num_speculative_tokens']}")
    else:
        best_label = "self_quantized (every configuration failed)"

    report = Report()
    base = results.get("bf16") or {}
    command = bench_model.command_line("bench_spec.py", sys.argv[1:])
    checkpoint = (model_dir.name if args.model
                  else "a random checkpoint with the exact Qwen3-0.6B shape")
    text = [
        "### Speculative decoding: batch-1 greedy decode of a bf16 target with drafts (cpu, "
        "bfloat16)", "",
        f"`{command}` on {checkpoint} (weights' std {std}, layer 0's down projection): greedy, EOS "
        f"ignored, {args.new_tokens} new tokens after a {PROMPT_LEN}-token prompt, {THREADS} torch "
        f"threads, each configuration in its own process, best of {REPEATS} after a warm-up "
        "generate. Decode tok/s: the tokens after the first over the time from the first to the "
        "last (the draft's catching up on the prompt included). self_quantized: the target's own "
        "weights quantised at load are the draft; ngram: prompt lookup in the prompt and the "
        "answer; *switch on*: the defaults (no speculation above batch 2, a sequence's drafts "
        "paused while they do not pay), the other rows speculate in every step. Prompts: "
        f"*ordinary* ({PROMPT_LEN} distinct tokens), *repeated* (an 8-token "
        f"sequence {PROMPT_LEN // 8} times). The plain bf16 answers have "
        f"{distinct(base.get('ordinary-b1'))} tokens of {args.new_tokens} (ordinary) and "
        f"{distinct(base.get('repeated-b1'))} (repeated). Acceptance rate: accepted / proposed "
        "draft tokens; mean acceptance length: tokens per verification step (accepted drafts + 1).",
        "", bench_model.machine_line("cpu"), "", *first_table(results, ks, quants, report), "",
        f"Aggregate decode at larger batches: the batch-1 fastest self_quantized configuration "
        f"({best_label}) with disable_by_batch_size {FORCE_ON} (speculation in every step) against "
        f"plain bf16 at the same batch, distinct {PROMPT_LEN}-token prompts (row 0 the ordinary "
        "prompt).", "",
        *batch_table(results, best_label, batches, report),
    ]
    if report.mismatches:
        text += ["", *report.mismatches]
    body = "\n".join(text)
    print(body)
    for line in report.mismatches:
        print(f"!!! {line}", file=sys.stderr)
    if args.write:
        bench_model.write_benchmarks(bench_model.section_name("bench_spec", "cpu")
                                     + (f"-{model_dir.name}" if args.model else ""), body)
    failed = [name for name, r in results.items() if r is None]
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
