"""nanoqwen vs llama.cpp on one CPU, in one run, on the same weights: prompt processing (512 tokens) and
batch-1 decode, at 16, 8 and 4 bits (bf16, int8 / q8_0, int4 / q4_0), each as a fraction of its bound.

    python bench/bench_llamacpp.py            # random checkpoint with the exact Qwen3-0.6B shape
    python bench/bench_llamacpp.py --write    # also record the table in BENCHMARKS.md
    python bench/bench_llamacpp.py --rounds 9 # more rounds (default 5)
    python bench/bench_llamacpp.py --num-scheduler-steps 1   # nanoqwen decodes one step a call (default 8)
    python bench/bench_llamacpp.py --gguf     # both on the same Q8_0, Q4_0, Q4_K_M, Q5_K_M files (--write: its table)

Needs llama-cpp-python (an optional benchmark dependency, never a test one): build it once with
`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python` (a long build on few cores; pip keeps the wheel),
plus `pip install sentencepiece`. To compare on AVX2 only on a bigger CPU, run nanoqwen with the AVX2 limits
(`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`) against a llama.cpp built
for AVX2 into a folder of its own, put first on PYTHONPATH:
`CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
pip install --no-cache-dir --target bench/.models/llama-cpp-avx2 llama-cpp-python` (the table names the
instruction sets the llama.cpp in use was built for). On an Intel Xeon with AMX the GGML_NATIVE
build crashed (SIGSEGV) on the first eval of a q8_0 or q4_0 file; the same flags without AMX
(`-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON`, into
bench/.models/llama-cpp-avx512-noamx, put first on PYTHONPATH) ran all three formats.
The checkpoint is converted with the `convert_hf_to_gguf.py` and `gguf-py` of the installed version's source
(downloaded once with pip into bench/.models/llama-cpp-src) to a bf16 GGUF, then quantised to q8_0 and q4_0
with llama_cpp.llama_model_quantize.

Procedure, the same for both (each system in its own process, the same thread count). All six systems are loaded
first, each in its own process (so each keeps its own peak memory), then timed in --rounds rounds: in a round, for
each bit width, llama.cpp and nanoqwen run one prompt processing and one batch-1 decode each, back to back (which
goes first alternates by round). A shared machine's speed drifts within minutes; timing two
systems minutes apart (as a run of one system after the other does) measures the drift as much as the systems. So
each "/ llama.cpp" ratio is the median of the rounds' ratios, each from two timings seconds apart, and each system's
figure is its best round. Prompt processing is one 512-token forward (llama.cpp: one `eval` of the tokens, batch
512; nanoqwen: a generate of 1 token); batch-1 decode is 64 tokens after a 32-token prompt (llama.cpp: 64 one-token
`eval` calls, as llama-bench's tg does, no sampling; nanoqwen: generate 65 tokens minus generate 1, greedy, with
num_scheduler_steps 8 unless --num-scheduler-steps says otherwise: up to 8 greedy steps in one C++ call;
bench/bench_multi_step.py measures what that buys). Each round also times every system at batch 16 (16 such prompts at
once, 64 greedy steps; llama.cpp in one context of 16 sequences, llamacpp_peer.LlamaBatchDecode), for nanoqwen against
llama.cpp, and int8 and int4 against bf16, there (not with --gguf). The bound of a decode row is the read bandwidth (a
sum of 1 GiB) over the bytes a step reads (every matrix once, the tied embedding as the LM head); of prefill, the
faster of the bf16 and float32 matmul rates over its FLOPs. The bandwidth is read twice for each decode timing, just
before and just after it, and that timing's bound uses the higher reading; each system's decode fraction of its bound
is the median of its rounds' fractions. The table also gives the best round over the highest reading of the whole run:
two extremes of a drifting machine, taken minutes apart, so an underestimate wherever the drift is large. Where the
kernel gives transparent huge pages, each reading also sums a second 1 GiB buffer in 2 MiB pages, the kind of memory
nanoqwen's weights are in, and the table gives the decode fraction against that too (a plain buffer's reading moves
with where its pages land).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (its checkpoint, children and ceilings)
import llamacpp_peer  # noqa: E402  (llama.cpp's GGUF files, build and batched decode)

DECODE_PROMPT, DECODE_TOKENS = 32, 64


def load_llama(gguf: str):
    """llama.cpp on one GGUF file (in this child process): calls timing one prompt processing, one batch-1 decode
    and one batch-16 decode (seconds; llamacpp_peer.LlamaBatchDecode, on a second load of the file), and its facts
    (the file's size)."""
    from llama_cpp import Llama

    threads = os.cpu_count() or 1
    llm = Llama(gguf, n_ctx=1024, n_batch=bench_model.PREFILL_LEN, n_ubatch=bench_model.PREFILL_LEN,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    long_prompt = bench_model.prompts(1, bench_model.PREFILL_LEN)[0]
    short = bench_model.prompts(1, DECODE_PROMPT)[0]

    def prefill() -> float:
        llm.reset()  # the next eval starts at position 0 (and drops the cache past it)
        start = time.perf_counter()
        llm.eval(long_prompt)
        return time.perf_counter() - start

    def decode() -> float:
        llm.reset()
        llm.eval(short)
        start = time.perf_counter()
        for i in range(DECODE_TOKENS):
            llm.eval([1000 + i])
        return time.perf_counter() - start

    batch = llamacpp_peer.LlamaBatchDecode(gguf, DECODE_TOKENS)
    return prefill, decode, lambda: batch(bench_model.prompts(16, DECODE_PROMPT)), {"file_bytes": os.path.getsize(gguf)}


def load_nanoqwen(model: str, quantization: str | None, num_scheduler_steps: int):
    """nanoqwen on the checkpoint (in this child process): as load_llama, with a batch-16 decode."""
    gen, info = bench_model.load_nanoqwen(model, "cpu", quantization=quantization,
                                          num_scheduler_steps=num_scheduler_steps)
    long_prompt = bench_model.prompts(1, bench_model.PREFILL_LEN)
    short = bench_model.prompts(1, DECODE_PROMPT)

    def timed(call) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    def decode(prompts: list[list[int]] = short) -> float:  # 64 steps: 65 tokens minus the first (the prefill)
        return timed(gen(prompts, 1 + DECODE_TOKENS)) - timed(gen(prompts, 1))

    def decode16() -> float:  # 16 sequences at once (their 64 steps)
        return decode(bench_model.prompts(16, DECODE_PROMPT))

    return lambda: timed(gen(long_prompt, 1)), decode, decode16, info


def child(system: str, model: str, num_scheduler_steps: int) -> None:
    """Load one system, warm it up, print READY and its facts, then time what each line of stdin names
    ("prefill", "decode" or "decode16"), one RESULT line each, until stdin closes."""
    if system.startswith("nanoqwen-gguf"):  # the GGUF file itself: its own weights, no --quantization
        prefill, decode, decode16, info = load_nanoqwen(model, None, num_scheduler_steps)
    elif system.startswith("nanoqwen"):
        prefill, decode, decode16, info = load_nanoqwen(model, system.partition("-")[2] or None, num_scheduler_steps)
    else:
        prefill, decode, decode16, info = load_llama(model)
    calls = {"prefill": prefill, "decode": decode, "decode16": decode16}
    for call in calls.values():  # warm-up
        call()
    print("READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        what = line.strip()
        print("RESULT " + json.dumps({what: calls[what]()}), flush=True)


class Child:
    """One system loaded in a process of its own, timed on request."""

    def __init__(self, system: str, model: str, num_scheduler_steps: int) -> None:
        self.system = system
        self.stderr = tempfile.TemporaryFile("w+")  # (a pipe nobody reads could fill and block the child)
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", system, "--model", model,
                                      "--num-scheduler-steps", str(num_scheduler_steps)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.info = json.loads(self._line("READY "))

    def _line(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
        self.proc.kill()
        self.stderr.seek(0)
        sys.exit(f"{self.system} failed:\n{self.stderr.read()[-3000:]}")

    def time(self, what: str) -> float:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line("RESULT "))[what]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


class ReadBandwidth:
    """The read bandwidth now (GB/s): a torch sum over 1 GiB of float32 (bench_model.read_bandwidth's measure), the
    best of three, the tensor kept between readings (so a reading takes a fraction of a second). Also, where the
    kernel gives 2 MiB pages (transparent huge pages), the same sum over a buffer in them, as nanoqwen's weights and
    KV cache lie (ops/cpu/memory.py): where a plain buffer's 4 KiB pages land moves its sum, so their own kind of
    memory is read too."""

    def __init__(self) -> None:
        import torch

        from nanoqwen.ops.cpu import memory

        self.x = torch.ones(1 << 28, dtype=torch.float32)
        self.x.sum()
        self.readings: list[float] = []
        self.x_huge = None
        if memory.kernel_gives_huge_pages():
            self.x_huge = memory.huge_page_buffer(1 << 30).view(torch.float32).fill_(1.0)
            self.x_huge.sum()
        self.huge_readings: list[float] = []

    def __call__(self) -> tuple[float, float | None]:
        """(the plain buffer's reading, the 2 MiB-page buffer's or None)."""
        self.readings.append(bench_model.sum_bandwidth(self.x, 3))
        if self.x_huge is None:
            return self.readings[-1], None
        self.huge_readings.append(bench_model.sum_bandwidth(self.x_huge, 3))
        return self.readings[-1], self.huge_readings[-1]


def run_rounds(children: dict[str, Child], pairs: list[tuple[str, str]], rounds: int, batch16: bool = True
               ) -> tuple[dict[str, dict], list[float], list[float]]:
    """Per system: its facts, its best rates, every round's rates, the read bandwidth beside each decode timing
    (the higher of the readings just before and just after it; also over 2 MiB pages, where there are) and
    (nanoqwen) the sorted per-round ratios against its llama.cpp pair; and every read bandwidth reading of the run
    (GB/s), plain and over 2 MiB pages. batch16: each round also times every system at batch 16, in turn."""
    rates = {name: {"prefill_tok_s": [], "decode_b1_tok_s": []} for name in children}
    beside = {name: [] for name in children}
    beside_huge = {name: [] for name in children}  # the same over the 2 MiB-page buffer, where there is one
    batched = [name for pair in pairs for name in pair if name in children] if batch16 else []
    read_bandwidth = ReadBandwidth()
    for r in range(rounds):
        for pair in pairs:
            for what, tokens, key in (("prefill", bench_model.PREFILL_LEN, "prefill_tok_s"),
                                      ("decode", DECODE_TOKENS, "decode_b1_tok_s")):
                for name in (pair if r % 2 == 0 else pair[::-1]):
                    if name in children:
                        before = read_bandwidth() if what == "decode" else (0.0, None)
                        rates[name][key].append(tokens / children[name].time(what))
                        if what == "decode":
                            after = read_bandwidth()
                            beside[name].append(max(before[0], after[0]))
                            if after[1] is not None:
                                beside_huge[name].append(max(before[1], after[1]))
        turn = r % max(1, len(batched))
        for name in batched[turn:] + batched[:turn]:  # every system at batch 16, in turn
            rates[name].setdefault("decode_b16_tok_s", []).append(16 * DECODE_TOKENS / children[name].time("decode16"))
        print(f"round {r + 1} of {rounds}: " + json.dumps({n: {k: round(v[-1], 1) for k, v in x.items() if v}
                                                            for n, x in rates.items()}), file=sys.stderr, flush=True)
    results = {}
    for name, child in children.items():
        results[name] = {**child.info, **{k: max(v) for k, v in rates[name].items()}, "rounds": rates[name],
                         "decode_bandwidth": beside[name], "decode_bandwidth_huge": beside_huge[name]}
    for llama, ours in pairs:
        if llama in children and ours in children:
            results[ours]["paired"] = {k: sorted(a / b for a, b in zip(rates[ours][k], rates[llama][k], strict=True))
                                       for k in ("prefill_tok_s", "decode_b1_tok_s", "decode_b16_tok_s")
                                       if k in rates[ours]}
    return results, read_bandwidth.readings, read_bandwidth.huge_readings


def table(results: dict[str, dict], bandwidth: list[float], huge: list[float], ceil: dict, rounds: int) -> str:
    matmul = max(ceil["bf16_tflop_s"], ceil.get("f32_tflop_s", 0.0)) * 1e12
    ours = results["nanoqwen"]
    flops_per_token = 2 * ours["layer_params"]

    def step_bytes(r: dict) -> int:  # every matrix read once a step (llama.cpp: the whole file)
        return r.get("decode_read_bytes", r.get("file_bytes"))

    def fraction_beside(r: dict, readings: str = "decode_bandwidth") -> list[float]:
        """Each round's decode rate over the bound read beside it (from the plain or the 2 MiB-page buffer)."""
        return sorted(rate * step_bytes(r) / (gb_s * 1e9)
                      for rate, gb_s in zip(r["rounds"]["decode_b1_tok_s"], r[readings], strict=True))

    rows = [("16-bit", "llama.cpp bf16", "llama-bf16", "nanoqwen bf16", "nanoqwen"),
            ("8-bit", "llama.cpp q8_0", "llama-q8_0", "nanoqwen int8", "nanoqwen-int8"),
            ("4-bit", "llama.cpp q4_0", "llama-q4_0", "nanoqwen int4", "nanoqwen-int4")]
    lines = ["| weights | system | prefill 512 (tok/s) | / llama.cpp | / bound | decode b1 (tok/s) | / llama.cpp "
             "| / bound beside it (rounds) | best / highest bound (tok/s) | / bound, 2 MiB pages (rounds) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    spreads = []
    for bits, llama_label, llama_key, our_label, our_key in rows:
        for label, key in ((llama_label, llama_key), (our_label, our_key)):
            r = results.get(key)
            if r is None:
                lines.append(f"| {bits} | {label} | – | | | – | | | | |")
                continue
            paired = r.get("paired", {})
            ratio = {k: f"{statistics.median(paired[k]):.2f}×" if k in paired else ""
                     for k in ("prefill_tok_s", "decode_b1_tok_s")}
            spreads += [f"{paired[k][0]:.2f}–{paired[k][-1]:.2f}" for k in paired]
            bound = max(bandwidth) * 1e9 / step_bytes(r)
            fractions = fraction_beside(r)
            huge_fraction = "–"
            if r["decode_bandwidth_huge"]:
                h = fraction_beside(r, "decode_bandwidth_huge")
                huge_fraction = f"{statistics.median(h):.0%} ({h[0]:.0%}–{h[-1]:.0%})"
            lines.append(f"| {bits} | {label} | {r['prefill_tok_s']:.1f} | {ratio['prefill_tok_s']} | "
                         f"{r['prefill_tok_s'] * flops_per_token / matmul:.0%} | {r['decode_b1_tok_s']:.1f} | "
                         f"{ratio['decode_b1_tok_s']} | **{statistics.median(fractions):.0%}** "
                         f"({fractions[0]:.0%}–{fractions[-1]:.0%}) | {r['decode_b1_tok_s'] / bound:.0%} "
                         f"({bound:.1f}) | {huge_fraction} |")
    lines += ["", f"Each system's figure is its best of {rounds} rounds; each \"/ llama.cpp\" is the median of the "
              f"rounds' ratios, each of two timings taken back to back (the rounds' ratios ranged: "
              f"{', '.join(spreads)}, in table order). Bounds measured in the same run: read bandwidth (sum of "
              f"1 GiB, just before and just after each decode timing) {min(bandwidth):.1f}–{max(bandwidth):.1f} "
              f"GB/s. \"/ bound beside it\": the median (and range) of the rounds' decode rates, each over the "
              f"bound from the higher of its two readings; \"best / highest bound\": the best round over the "
              f"bound from the run's highest reading (in parentheses, tok/s); \"/ bound, 2 MiB pages\": as \"beside "
              f"it\", the same sum over a buffer in 2 MiB pages, as nanoqwen's weights are ("
              + (f"{min(huge):.1f}–{max(huge):.1f} GB/s" if huge else "not measured: no transparent huge pages")
              + "; a second view of the bound, not the bold column's). Matmul "
              f"{ceil['bf16_tflop_s'] * 1e3:.0f} GFLOP/s in bf16, {ceil.get('f32_tflop_s', 0) * 1e3:.0f} in "
              f"float32 (prefill's bound: the faster, over {flops_per_token / 1e9:.2f} GFLOP a token); decode: the "
              "read bandwidth over the bytes a step reads (nanoqwen: every projection and the LM head; "
              "llama.cpp: its GGUF file, whose tied embedding is its LM head)."]
    quantized = []
    for name in ("int8", "int4"):
        r = results.get(f"nanoqwen-{name}")
        if r is not None:
            ratios = {k: statistics.median(a / b for a, b in zip(r["rounds"][k], ours["rounds"][k], strict=True))
                      for k in ("prefill_tok_s", "decode_b1_tok_s", "decode_b16_tok_s")}
            quantized.append(f"{name} prefill {ratios['prefill_tok_s']:.2f}×, batch-1 decode "
                             f"{ratios['decode_b1_tok_s']:.2f}×, batch-16 decode {ratios['decode_b16_tok_s']:.2f}×")
    b16 = []
    for bits, llama_label, llama_key, our_label, our_key in rows:
        shown = [f"{label} {results[key]['decode_b16_tok_s']:.1f}" for label, key in ((llama_label, llama_key),
                                                                                      (our_label, our_key))
                 if key in results]
        paired = results.get(our_key, {}).get("paired", {}).get("decode_b16_tok_s")
        b16.append(f"{bits}: {', '.join(shown)}" + (f" ({statistics.median(paired):.2f}×)" if paired else ""))
    lines += ["", "At batch 16 (16 sequences of 32-token prompts at once, 64 greedy steps; llama.cpp in one context of "
              "16 sequences, llamacpp_peer.LlamaBatchDecode), tok/s, best round (nanoqwen against llama.cpp: the "
              "median of the rounds' ratios): " + "; ".join(b16) + "."]
    if quantized:
        lines += ["", "nanoqwen's int8 and int4 against its bf16 (the median of the rounds' ratios): "
                  + "; ".join(quantized) + "."]
    return "\n".join(lines)


def gguf_table(results: dict[str, dict], pairs: list[tuple[str, str]], rounds: int) -> str:
    """--gguf: both systems on each file: speeds, nanoqwen's ratios to llama.cpp, and the weights in memory."""
    lines = ["| file | system | prefill 512 (tok/s) | / llama.cpp | decode b1 (tok/s) | / llama.cpp | "
             "weights in memory (MiB) | / file's tensor bytes |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for llama, ours in pairs:
        fmt = llama.partition("-")[2].upper()
        tensor_bytes = results.get(ours, {}).get("gguf_tensor_bytes")
        for label, key in ((f"llama.cpp {fmt}", llama), (f"nanoqwen {fmt}", ours)):
            r = results.get(key)
            if r is None:
                lines.append(f"| {fmt} | {label} | – | | – | | | |")
                continue
            paired = r.get("paired", {})
            ratio = {k: f"{statistics.median(paired[k]):.2f}×" if k in paired else ""
                     for k in ("prefill_tok_s", "decode_b1_tok_s")}
            held = r.get("weight_bytes", r.get("file_bytes"))
            share = f"{held / tensor_bytes:.2f}" if tensor_bytes and "weight_bytes" in r else ""
            lines.append(f"| {fmt} | {label} | {r['prefill_tok_s']:.1f} | {ratio['prefill_tok_s']} | "
                         f"{r['decode_b1_tok_s']:.1f} | {ratio['decode_b1_tok_s']} | {held / 2**20:.0f} | {share} |")
    lines += ["", f"Each system's figure is its best of {rounds} rounds; each \"/ llama.cpp\" is the median of the "
              "rounds' ratios, each of two timings taken back to back. Weights in memory: nanoqwen's weight tensors "
              "(LLMEngine.weight_bytes), llama.cpp's file size (it maps the file)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: bench_model's random Qwen3-0.6B)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of timings (each system's best counts)")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--num-scheduler-steps", type=int, default=8, metavar="K",
                        help="nanoqwen's greedy decode steps in one go (EngineConfig.num_scheduler_steps; default 8)")
    parser.add_argument("--gguf", action="store_true",
                        help="nanoqwen loads the same Q8_0, Q4_0, Q4_K_M, Q5_K_M GGUF files llama.cpp runs (its own "
                             "table)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.model, args.num_scheduler_steps)
    llama_cpp = llamacpp_peer.import_llama_cpp()
    model_dir = Path(args.model) if args.model else bench_model.DEFAULT_DIR
    bench_model.ensure_checkpoint(model_dir)
    files = llamacpp_peer.gguf_files(model_dir)
    print("running ceilings ...", file=sys.stderr)
    ceil = bench_model.run_child("ceilings", model_dir, "cpu", 3)
    pairs = [("llama-bf16", "nanoqwen"), ("llama-q8_0", "nanoqwen-int8"), ("llama-q4_0", "nanoqwen-int4")]
    if args.gguf:
        pairs = [("llama-q8_0", "nanoqwen-gguf-q8_0"), ("llama-q4_0", "nanoqwen-gguf-q4_0"),
                 ("llama-q4_k_m", "nanoqwen-gguf-q4_k_m"), ("llama-q5_k_m", "nanoqwen-gguf-q5_k_m")]
    children = {}
    try:
        for llama, ours in pairs:
            fmt = llama.partition("-")[2]
            for name, model in ((llama, str(files[fmt])),
                                (ours, str(files[fmt] if args.gguf else model_dir))):
                print(f"loading {name} ...", file=sys.stderr, flush=True)
                try:
                    children[name] = Child(name, model, args.num_scheduler_steps)
                except SystemExit as e:  # a system that fails to load does not stop the others (its row: –)
                    print(e, file=sys.stderr)
        if not any(name.startswith("nanoqwen") for name in children):
            sys.exit("no table: nanoqwen failed to load")
        results, bandwidth, huge = run_rounds(children, pairs, args.rounds, batch16=not args.gguf)
    finally:
        for c in children.values():
            c.close()
    instructions = llamacpp_peer.llama_instructions()
    if args.gguf:
        for _, ours in pairs:
            if ours in results:
                fmt = ours.rpartition("-gguf-")[2]
                results[ours]["gguf_tensor_bytes"] = llamacpp_peer.gguf_tensor_bytes(files[fmt])
        body = (f"### nanoqwen vs llama.cpp on the same GGUF files (llama-cpp-python {llama_cpp.__version__}), CPU\n\n"
                f"llama.cpp built for: {' '.join(instructions)}.\n\n"
                f"`python bench/bench_llamacpp.py --gguf`: "
                f"{'a random checkpoint with the exact Qwen3-0.6B shape' if not args.model else model_dir.name}, "
                "converted to GGUF bf16 and quantised with llama.cpp's llama_model_quantize to Q8_0, Q4_0, Q4_K_M "
                "and Q5_K_M; "
                "nanoqwen loads each file (`--model FILE.gguf`) and computes with its weights as they are. "
                f"{os.cpu_count()} threads for both, nanoqwen decodes with num_scheduler_steps "
                f"{args.num_scheduler_steps}; timed in rounds as the script's docstring says.\n\n"
                f"{bench_model.machine_line('cpu')}\n\n" + gguf_table(results, pairs, args.rounds))
        print(body)
        if args.write:
            bench_model.write_benchmarks(bench_model.section_name("bench_llamacpp", "cpu") + "-gguf", body)
        return
    body = (f"### nanoqwen vs llama.cpp (llama-cpp-python {llama_cpp.__version__}), CPU\n\n"
            f"llama.cpp built for: {' '.join(instructions)}.\n\n"
            f"`python bench/bench_llamacpp.py` on "
            f"{'a random checkpoint with the exact Qwen3-0.6B shape' if not args.model else model_dir.name}, "
            f"converted to GGUF bf16 and quantised to q8_0 / q4_0; nanoqwen int8 and int4 are made at load "
            f"from the same bf16 checkpoint; nanoqwen decodes with num_scheduler_steps {args.num_scheduler_steps}. "
            f"{os.cpu_count()} threads for both; all six loaded at once, each in "
            f"its own process, and timed in rounds (the script's docstring).\n\n"
            f"{bench_model.machine_line('cpu')}\n\n" + table(results, bandwidth, huge, ceil, args.rounds))
    print(body)
    if args.write:
        # a llama.cpp built without AVX-512 (an AVX2-only build, for a like-for-like AVX2 comparison) gets its
        # own table beside the native build's
        suffix = "" if "AVX512" in instructions else "-llama-avx2"
        bench_model.write_benchmarks(bench_model.section_name("bench_llamacpp", "cpu") + suffix, body)


if __name__ == "__main__":
    main()
