"""Correctness checks that need a CUDA GPU (run by bench/gpu.sh; each prints PASS / FAIL lines).

    python bench/gpu_check.py kernels           # paged decode kernels vs the reference, in and out of a CUDA graph
    python bench/gpu_check.py parity [--model DIR]   # greedy tokens: graphs, eager, gather path, transformers
    python bench/gpu_check.py features --model DIR   # sampling, speculation, prefix caching, pooling vs CPU

Exit status 1 when a check fails. The CPU tests (tests/attention/test_paged_attention.py) cover the same logic
without a GPU.
`--device cpu` is a dry run of this script itself (tiny shapes, the Triton kernel under TRITON_INTERPRET=1, no
graphs or timings; parity with a small model folder given by --model).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

if "--device" in sys.argv and "cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is defined

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoqwen.attention.backends.paged import has_module, paged_decode_attention  # noqa: E402
from nanoqwen.attention.backends.paged import paged_decode_attention_reference as reference  # noqa: E402

DEVICE = torch.device("cuda")
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
failures: list[str] = []


def report(ok: bool, what: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {what}", flush=True)
    if not ok:
        failures.append(what)


def random_case(b: int, hq: int, hkv: int, d: int, block_size: int, lens: list[int], dtype: torch.dtype,
                seed: int = 0, num_blocks: int = 0, width: int = 0):
    """A cache of random keys/values, b sequences of the given lengths on shuffled blocks, their queries.
    num_blocks and width (the cache's blocks, the block table's columns): at least what the lengths need."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    # wider than needed, as a graph's static table is
    width = max(width, max(-(-n // block_size) for n in lens) + 2)
    num_blocks = max(num_blocks, sum(-(-n // block_size) for n in lens) + 4)
    k = torch.randn(num_blocks, block_size, hkv, d, device=DEVICE, dtype=dtype, generator=g)
    v = torch.randn(num_blocks, block_size, hkv, d, device=DEVICE, dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=g)
    tables = torch.zeros(b, width, dtype=torch.int32, device=DEVICE)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used: used + nb]
        used += nb
    q = torch.randn(b, hq, d, device=DEVICE, dtype=dtype, generator=g)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def check_kernels() -> None:
    backends = [b for b, mod in (("triton", "triton"), ("flash", "flash_attn")) if has_module(mod)]
    print(f"paged decode backends available: {backends or 'none'}")
    lens = [0, 1, 15, 16, 17, 100, 1000, 4097]  # 0: a CUDA-graph padding row
    # (Hq, Hkv, D): Qwen3-0.6B/1.7B (G=2), 4B/8B (G=4), 14B (G=5), 32B (G=8); a small head_dim
    shapes = [(16, 8, 128), (32, 8, 128), (40, 8, 128), (64, 8, 128), (8, 4, 64)]
    for backend in backends:
        block_size = 256 if backend == "flash" else 16
        # every shape in bf16; the other dtypes and block sizes on Qwen3-0.6B's shape (each case compiles once)
        cases = [(torch.bfloat16, block_size, shape) for shape in shapes]
        cases += [(torch.float16, block_size, shapes[0])]
        if backend == "triton":
            cases += [(torch.float32, block_size, shapes[0]), (torch.bfloat16, 32, shapes[0])]
        if DEVICE.type == "cpu":  # dry run under the interpreter (whose bf16 tl.dot is broken): small, float32
            lens, cases = [0, 1, 17, 40], [(torch.float32, 16, (4, 2, 16)), (torch.float32, 32, (10, 2, 16))]
        for dtype, bs, (hq, hkv, d) in cases:
            q, k, v, tables, ctx = random_case(len(lens), hq, hkv, d, bs, lens, dtype)
            expected = reference(q, k, v, tables, ctx, d**-0.5)
            out = paged_decode_attention(q, k, v, tables, ctx, d**-0.5, backend)
            err = (out.float() - expected.float()).abs().max().item()
            zeros = bool(out[0].eq(0).all())
            report(err <= TOLERANCE[dtype] and zeros and bool(out.isfinite().all()),
                   f"{backend} {str(dtype)[6:]} block {bs} Hq {hq} Hkv {hkv} D {d}: max |err| {err:.1e}, "
                   f"padding row zeros {zeros}")
        if DEVICE.type == "cuda":
            check_in_graph(backend)
            time_kernel(backend)


def check_in_graph(backend: str) -> None:
    """Capture the kernel on static tensors, change their contents, replay: the output follows the new contents."""
    bs = 256 if backend == "flash" else 16
    # the same shapes for both cases: the graph's tensors are static
    fixed = dict(num_blocks=-(-320 // bs) * 4 + 4, width=-(-320 // bs) + 2)
    q, k, v, tables, ctx = random_case(4, 16, 8, 128, bs, [300, 5, 1, 0], torch.bfloat16, seed=1, **fixed)
    out = torch.empty_like(q)
    paged_decode_attention(q, k, v, tables, ctx, 128**-0.5, backend, out=out)  # warm-up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k, v, tables, ctx, 128**-0.5, backend, out=out)
    q2, k2, v2, tables2, ctx2 = random_case(4, 16, 8, 128, bs, [0, 290, 17, 2], torch.bfloat16, seed=2, **fixed)
    for static, new in ((q, q2), (k, k2), (v, v2), (tables, tables2), (ctx, ctx2)):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    err = (out.float() - reference(q2, k2, v2, tables2, ctx2, 128**-0.5).float()).abs().max().item()
    report(err <= TOLERANCE[torch.bfloat16] and bool(out[0].eq(0).all()),
           f"{backend} replayed from a CUDA graph with new block tables and lengths: max |err| {err:.1e}")


def time_kernel(backend: str) -> None:
    """256 sequences of ~1000 tokens, Qwen3-0.6B's attention shape: time per call and KV bytes read per second."""
    bs = 256 if backend == "flash" else 16
    lens = [random.Random(i).randint(600, 1400) for i in range(256)]
    q, k, v, tables, ctx = random_case(256, 16, 8, 128, bs, lens, torch.bfloat16, seed=3)
    kv_bytes = 2 * sum(lens) * 8 * 128 * 2
    for name, fn in ((backend, lambda: paged_decode_attention(q, k, v, tables, ctx, 128**-0.5, backend)),
                     ("torch reference", lambda: reference(q, k, v, tables, ctx, 128**-0.5))):
        fn()
        torch.cuda.synchronize()
        start, n = time.perf_counter(), 20
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / n
        print(f"time  {name}: 256 x ~1000 tokens, {seconds * 1e6:.0f} us per call "
              f"({kv_bytes / seconds / 1e9:.0f} GB/s of keys and values)", flush=True)


def greedy(llm, prompts: list[list[int]], n: int):
    from nanoqwen import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    return [o.token_ids for o in outs], [[sorted(d.values(), key=lambda x: -x.logprob) for d in o.logprobs]
                                         for o in outs]


def margin(top: list) -> float:
    """Gap between the two best log-probabilities (a near tie flips with any rounding difference)."""
    return top[0].logprob - top[1].logprob if len(top) > 1 else float("inf")


def check_parity(model_dir: str, dtype: str = "bfloat16", new_tokens: int = 32) -> None:
    from nanoqwen import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(n)] for n in (7, 33, 100, 250, 3)]  # 5 rows: bucket 8
    runs = {}
    kwargs = dict(dtype=dtype, device=DEVICE.type, max_model_len=512, max_num_seqs=8, kv_cache_memory=1 << 30)
    # on CPU (a dry run) "auto" is the gather path: force the paged reference and the padded runner instead
    paged = "auto" if DEVICE.type == "cuda" else "torch"
    for name, env, eager in (("graphs", paged, False), ("eager", paged, True), ("gather", "off", True)):
        os.environ["NANOQWEN_PAGED_ATTENTION"] = env
        start = time.perf_counter()
        llm = LLM(model_dir, enforce_eager=eager, **kwargs)
        runner = llm.llm_engine.runner
        graphs = runner.graph_runner.batch_sizes if runner.graph_runner else None
        print(f"nanoqwen {name}: backend {runner.attention_backend}, graphs {graphs}, "
              f"ready in {time.perf_counter() - start:.1f} s", flush=True)
        runs[name] = greedy(llm, prompts, new_tokens)
        del llm, runner
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    os.environ.pop("NANOQWEN_PAGED_ATTENTION")
    for name in ("graphs", "eager"):
        compare(f"nanoqwen {name} vs nanoqwen gather path", runs[name], runs["gather"])
    if not has_module("transformers"):
        print("SKIP  transformers is not installed: no comparison with it")
        return
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                              attn_implementation="sdpa").to(DEVICE).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0,
                                           eos_token_id=None, pad_token_id=0, output_scores=True,
                                           return_dict_in_generate=True)
    tokens, tops = [], []
    for p in prompts:  # one at a time: no padding
        with torch.inference_mode():
            out = model.generate(torch.tensor([p], device=DEVICE), generation_config=config)
        tokens.append(out.sequences[0, len(p):].tolist())
        # the scores of greedy decoding are the raw logits: their top-2 log-probabilities at every step
        tops.append([[SimpleNamespace(logprob=x) for x in scores[0].float().log_softmax(-1).topk(2).values.tolist()]
                     for scores in out.scores])
    compare("nanoqwen graphs vs transformers (sdpa)", runs["graphs"], (tokens, tops))


def check_features(models: Path) -> None:
    """What parity does not reach, on tiny random float32 models (weights N(0, 0.08): greedy tokens are not near
    ties), against the same on CPU unless said: logprobs and the penalties, seeded sampling (the same tokens
    twice), prefix-cache hits, speculative decoding (ngram, and a draft model), forks (n=2), embeddings and
    reranker scores, structured outputs (when llguidance is installed). models: a folder with tiny/,
    embedding-tiny/ and reranker-tiny/ (bench/gpu.sh writes them)."""
    from nanoqwen import LLM, SamplingParams

    kwargs = dict(dtype="float32", max_model_len=256, max_num_seqs=8, kv_cache_memory=256 << 20)
    # the CPU side eager: the plain functions (the reference), no torch.compile to wait for on the GPU's host
    on_cpu = dict(enforce_eager=True)
    rng = random.Random(1)
    prompts = [[rng.randrange(10000) for _ in range(n)] for n in (5, 40, 17)]
    repetitive = [[11, 12, 13, 14] * 8]  # ngram drafts find their tokens in it

    def run(device: str, params: SamplingParams, prompts: list, **options):
        llm = LLM(str(models / "tiny"), device=device, **{**kwargs, **(on_cpu if device == "cpu" else {}), **options})
        outs = llm.generate(prompts, params, use_tqdm=False)
        del llm
        gc.collect()
        return outs

    def tokens(outs) -> list[list[int]]:
        return [c.token_ids for o in outs for c in o.outputs]

    on = DEVICE.type
    penalties = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3, repetition_penalty=1.3,
                               presence_penalty=0.5, frequency_penalty=0.4, min_tokens=4)
    ours, cpu = run(on, penalties, prompts), run("cpu", penalties, prompts)
    worst = max(abs(a[t].logprob - b[t].logprob) for x, y in zip(ours, cpu, strict=True)
                for a, b in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True) for t in a if t in b)
    report(tokens(ours) == tokens(cpu) and worst < 1e-3,
           f"greedy with penalties and logprobs, {on} vs cpu: tokens equal {tokens(ours) == tokens(cpu)}, "
           f"max |logprob difference| {worst:.1e}")
    seeded = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, max_tokens=24, ignore_eos=True,
                            seed=7)
    first, second = run(on, seeded, prompts), run(on, seeded, prompts)
    report(tokens(first) == tokens(second), f"seeded sampling on {on}: the same tokens twice")
    greedy_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = tokens(run(on, greedy_params, repetitive + prompts))
    for name, spec in (("ngram", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
                       ("draft model", {"method": "draft_model", "model": str(models / "tiny"),
                                        "num_speculative_tokens": 3})):
        got = tokens(run(on, greedy_params, repetitive + prompts, speculative_config=spec))
        report(got == plain, f"speculative decoding ({name}) on {on}: the greedy tokens without it")
    llm = LLM(str(models / "tiny"), device=on, enable_prefix_caching=True, **kwargs)
    base = prompts[1]
    llm.generate([base], greedy_params, use_tqdm=False)  # caches its blocks
    hit = llm.generate([base + [7, 8, 9]], greedy_params, use_tqdm=False)
    cached = hit[0].num_cached_tokens
    del llm
    gc.collect()
    fresh = run(on, greedy_params, [base + [7, 8, 9]], enable_prefix_caching=False)
    report(tokens(hit) == tokens(fresh) and cached > 0,
           f"prefix-cache hit on {on} ({cached} tokens cached): the tokens of a fresh engine")
    forks = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
    got = tokens(run(on, forks, prompts[:1]))
    report(got[0] == got[1] == tokens(run("cpu", greedy_params, prompts[:1]))[0][:12],
           f"n=2 (greedy forks) on {on}: both the greedy answer")
    for task, preset in (("embed", "embedding-tiny"), ("score", "reranker-tiny")):
        values = {}
        for device in (on, "cpu"):
            llm = LLM(str(models / preset), device=device, **kwargs, **(on_cpu if device == "cpu" else {}))
            if task == "embed":
                outs = llm.embed(["a first text", "and a second, longer one"], use_tqdm=False)
                values[device] = torch.tensor([o.outputs.embedding for o in outs])
            else:
                outs = llm.score("a query", ["one document", "another document"], use_tqdm=False)
                values[device] = torch.tensor([o.outputs.score for o in outs])
            del llm
            gc.collect()
        err = (values[on] - values["cpu"]).abs().max().item()
        report(err < 1e-4, f"{task} ({preset}) on {on} vs cpu: max |difference| {err:.1e}")
    if not has_module("llguidance"):
        print("SKIP  structured outputs: llguidance is not installed")
        return
    from nanoqwen.sampling_params import StructuredOutputsParams

    choice = ["yes", "no", "maybe"]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=choice))
    outs = run(on, params, ["Answer:"] * 3)
    texts = [o.outputs[0].text for o in outs]
    report(all(t in choice for t in texts), f"structured outputs (choice) on {on}: {texts}")


def compare(what: str, ours, theirs) -> None:
    """Greedy tokens equal, or diverging only at a near tie (both sides' top-2 gap under 0.1 nats)."""
    ok, notes = True, []
    for i, (a, b, ta, tb) in enumerate(zip(ours[0], theirs[0], ours[1], theirs[1], strict=True)):
        if a == b:
            continue
        j = next(k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        gaps = margin(ta[j]), margin(tb[j])
        tie = max(gaps) < 0.1
        ok &= tie
        notes.append(f"row {i} differs from token {j} (top-2 gaps {gaps[0]:.3f} / {gaps[1]:.3f}"
                     f"{': a near tie' if tie else ''})")
    same = sum(a == b for a, b in zip(ours[0], theirs[0], strict=True))
    report(ok, f"{what}: {same} of {len(ours[0])} rows identical" + (f"; {'; '.join(notes)}" if notes else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["kernels", "parity", "features"])
    parser.add_argument("--model", default=str(Path(__file__).resolve().parent / ".models" / "qwen3-0.6b-random-bf16"),
                        help="parity: the model folder; features: a folder of tiny/, embedding-tiny/, reranker-tiny/")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of this script")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="parity: the model dtype")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU: these checks need one (tests/attention/test_paged_attention.py covers the logic on CPU)")
    if args.check == "kernels":
        check_kernels()
    elif args.check == "parity":
        check_parity(args.model, args.dtype)
    else:
        check_features(Path(args.model))
    if failures:
        sys.exit(f"{len(failures)} check(s) failed")


if __name__ == "__main__":
    main()
