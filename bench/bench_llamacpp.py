"""nanoqwen vs llama.cpp on one CPU, in one run, on the same weights: prompt processing (512 tokens) and
batch-1 decode, at 16, 8 and 4 bits (bf16, int8 / q8_0, int4 / q4_0), each as a fraction of its bound.

    python bench/bench_llamacpp.py            # random checkpoint with the exact Qwen3-0.6B shape
    python bench/bench_llamacpp.py --write    # also record the table in BENCHMARKS.md

Needs llama-cpp-python (an optional benchmark dependency, never a test one): build it once with
`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python` (15-25 minutes on 2 cores; pip keeps the wheel),
plus `pip install sentencepiece`. To compare on AVX2 only on a bigger CPU, run nanoqwen with the AVX2 limits
(`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`) against a llama.cpp built
for AVX2 into a folder of its own, put first on PYTHONPATH:
`CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
pip install --no-cache-dir --target bench/.models/llama-cpp-avx2 llama-cpp-python` (the table names the
instruction sets the llama.cpp in use was built for).
The checkpoint is converted with the `convert_hf_to_gguf.py` and `gguf-py` of the installed version's source
(downloaded once with pip into bench/.models/llama-cpp-src) to a bf16 GGUF, then quantised to q8_0 and q4_0
with llama_cpp.llama_model_quantize.

Procedure, the same for both (each system in its own process, the same thread count): prompt processing is
the best time of one 512-token forward (llama.cpp: one `eval` of the tokens, batch 512; nanoqwen: a generate
of 1 token); batch-1 decode is 64 tokens after a 32-token prompt (llama.cpp: 64 one-token `eval` calls, as
llama-bench's tg does, no sampling; nanoqwen: generate 65 tokens minus generate 1, greedy).
The bound of a decode row is the read bandwidth (measured in that system's own process, before and after its
run: the higher) over the bytes a step reads (every matrix once, the tied embedding as the LM head); of
prefill, the faster of the bf16 and float32 matmul rates over its FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (its checkpoint, children and ceilings)

ROOT = bench_model.ROOT
GGUF_DIR = ROOT / "bench" / ".models" / "gguf"
SRC_DIR = ROOT / "bench" / ".models" / "llama-cpp-src"
FORMATS = ("bf16", "q8_0", "q4_0")
DECODE_PROMPT, DECODE_TOKENS = 32, 64


def llama_instructions() -> list[str]:
    """The x86 instruction sets the installed llama.cpp was built to use (from llama_print_system_info),
    e.g. ["AVX2", "FMA", "F16C", "AVX512", ...]: a GGML_NATIVE build on an AVX-512 CPU uses AVX-512 even
    when nanoqwen is limited to AVX2, so the table names them."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    wanted = ("AVX", "AVX2", "FMA", "F16C", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "AMX_INT8")
    flags = dict(part.split(" = ") for part in info.replace("CPU : ", "").split(" | ") if " = " in part)
    return [f for f in wanted if flags.get(f) == "1"]


def llama_source() -> Path:
    """The installed llama-cpp-python's vendored llama.cpp source (for its GGUF converter), fetched once."""
    import llama_cpp

    version = llama_cpp.__version__
    found = sorted(SRC_DIR.glob(f"llama_cpp_python-{version}/vendor/llama.cpp"))
    if found:
        return found[0]
    SRC_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d",
                    str(SRC_DIR), f"llama-cpp-python=={version}"], check=True)
    with tarfile.open(next(SRC_DIR.glob(f"llama_cpp_python-{version}.tar.gz"))) as tar:
        tar.extractall(SRC_DIR, filter="data")
    return SRC_DIR / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def gguf_files(model_dir: Path) -> dict[str, Path]:
    """The checkpoint as GGUF files, bf16 converted from it and quantised from that (made once)."""
    import llama_cpp

    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    files = {fmt: GGUF_DIR / f"{model_dir.name}-{fmt}.gguf" for fmt in FORMATS}
    if not files["bf16"].exists():
        src = llama_source()
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "bf16",
                        "--outfile", str(files["bf16"])], check=True, env=env)
    for fmt in ("q8_0", "q4_0"):
        if not files[fmt].exists():
            ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{fmt.upper()}")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            params.nthread = os.cpu_count() or 1
            if llama_cpp.llama_model_quantize(str(files["bf16"]).encode(), str(files[fmt]).encode(), params):
                sys.exit(f"llama_model_quantize to {fmt} failed")
    return files


def run_llama(gguf: str, repeats: int) -> dict:
    """llama.cpp's prompt processing and batch-1 decode on one GGUF file (in this child process)."""
    from llama_cpp import Llama

    threads = os.cpu_count() or 1
    llm = Llama(gguf, n_ctx=1024, n_batch=bench_model.PREFILL_LEN, n_ubatch=bench_model.PREFILL_LEN,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    long_prompt = bench_model.prompts(1, bench_model.PREFILL_LEN)[0]

    def prefill() -> None:
        llm.reset()  # the next eval starts at position 0 (and drops the cache past it)
        llm.eval(long_prompt)

    prefill()  # warm-up
    prefill_s = bench_model.best_of(prefill, repeats)
    short = bench_model.prompts(1, DECODE_PROMPT)[0]
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        llm.reset()
        llm.eval(short)
        start = time.perf_counter()
        for i in range(DECODE_TOKENS):
            llm.eval([1000 + i])
        best = min(best, time.perf_counter() - start)
    return {"prefill_tok_s": bench_model.PREFILL_LEN / prefill_s, "decode_b1_tok_s": DECODE_TOKENS / best,
            "file_bytes": os.path.getsize(gguf)}


def child(system: str, model: str, repeats: int) -> None:
    # A shared machine's bandwidth drifts within a run (one reading at the start made shares above 100%), so
    # each system's bound uses the higher of two readings taken in its own process, just before and after it.
    before = bench_model.read_bandwidth()
    if system.startswith("nanoqwen"):  # prefill and batch-1 decode only (bench_model.py measures batch 16)
        quantization = system.partition("-")[2] or None
        result = bench_model.run_nanoqwen(model, "cpu", repeats, quantization=quantization, batches=(1,))
    else:
        result = run_llama(model, repeats)
    result["read_gb_s"] = max(before, bench_model.read_bandwidth())
    print("RESULT " + json.dumps(result))


def run_child(system: str, model: str, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--child", system, "--model", model, "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{system} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def table(results: dict, ceil: dict) -> str:
    matmul = max(ceil["bf16_tflop_s"], ceil.get("f32_tflop_s", 0.0)) * 1e12
    ours = results["nanoqwen"]
    flops_per_token = 2 * ours["layer_params"]

    def decode_bound(r: dict) -> float:  # every matrix read once a step (llama.cpp: the whole file)
        return r.get("read_gb_s", ceil["read_gb_s"]) * 1e9 / r.get("decode_read_bytes", r.get("file_bytes"))

    rows = [("16-bit", "llama.cpp bf16", "llama-bf16", "nanoqwen bf16", "nanoqwen"),
            ("8-bit", "llama.cpp q8_0", "llama-q8_0", "nanoqwen int8", "nanoqwen-int8"),
            ("4-bit", "llama.cpp q4_0", "llama-q4_0", "nanoqwen int4", "nanoqwen-int4")]
    lines = ["| weights | system | prefill 512 (tok/s) | / llama.cpp | / bound | decode b1 (tok/s) | / llama.cpp "
             "| / bound (tok/s) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for bits, llama_label, llama_key, our_label, our_key in rows:
        theirs = results.get(llama_key)
        for label, key in ((llama_label, llama_key), (our_label, our_key)):
            r = results.get(key)
            if r is None:
                lines.append(f"| {bits} | {label} | – | | | – | | |")
                continue
            ratio = {k: f"{r[k] / theirs[k]:.2f}×" if theirs and key != llama_key else ""
                     for k in ("prefill_tok_s", "decode_b1_tok_s")}
            bound = decode_bound(r)
            lines.append(f"| {bits} | {label} | {r['prefill_tok_s']:.1f} | {ratio['prefill_tok_s']} | "
                         f"{r['prefill_tok_s'] * flops_per_token / matmul:.0%} | {r['decode_b1_tok_s']:.1f} | "
                         f"{ratio['decode_b1_tok_s']} | {r['decode_b1_tok_s'] / bound:.0%} ({bound:.1f}) |")
    reads = [r["read_gb_s"] for key, r in results.items() if key != "ceilings" and "read_gb_s" in r]
    lines += ["", f"Bounds measured in the same run: read bandwidth (sum of 1 GiB) {ceil['read_gb_s']:.1f} GB/s "
              f"at the start, {min(reads, default=0):.1f}–{max(reads, default=0):.1f} GB/s in the systems' own "
              "processes (each decode bound uses its own: the higher of a reading before and after it); "
              f"matmul {ceil['bf16_tflop_s'] * 1e3:.0f} GFLOP/s in bf16, {ceil.get('f32_tflop_s', 0) * 1e3:.0f} in "
              f"float32 (prefill's bound: the faster, over {flops_per_token / 1e9:.2f} GFLOP a token); decode: the "
              "read bandwidth over the bytes a step reads (nanoqwen: every projection and the LM head; "
              "llama.cpp: its GGUF file, whose tied embedding is its LM head)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: bench_model's random Qwen3-0.6B)")
    parser.add_argument("--repeats", type=int, default=3, help="best of N timings")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.model, args.repeats)
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install llama-cpp-python "
                 "sentencepiece (15-25 minutes on 2 cores, once)")
    model_dir = Path(args.model) if args.model else bench_model.DEFAULT_DIR
    bench_model.ensure_checkpoint(model_dir)
    files = gguf_files(model_dir)
    results = {}
    jobs = [("ceilings", lambda: bench_model.run_child("ceilings", model_dir, "cpu", args.repeats))]
    for fmt in FORMATS:
        jobs.append((f"llama-{fmt}", lambda f=fmt: run_child(f"llama-{f}", str(files[f]), args.repeats)))
    for system in ("nanoqwen", "nanoqwen-int8", "nanoqwen-int4"):
        jobs.append((system, lambda s=system: run_child(s, str(model_dir), args.repeats)))
    for system, run in jobs:
        print(f"running {system} ...", file=sys.stderr)
        try:
            results[system] = run()
        except SystemExit as e:
            print(e, file=sys.stderr)
            continue
        print(f"{system}: {json.dumps(results[system])}", file=sys.stderr, flush=True)
    if "ceilings" not in results or "nanoqwen" not in results:
        sys.exit("no table: the ceilings or nanoqwen failed")
    instructions = llama_instructions()
    body = (f"### nanoqwen vs llama.cpp (llama-cpp-python {llama_cpp.__version__}), CPU\n\n"
            f"llama.cpp built for: {' '.join(instructions)}.\n\n"
            f"`python bench/bench_llamacpp.py` on "
            f"{'a random checkpoint with the exact Qwen3-0.6B shape' if not args.model else model_dir.name}, "
            f"converted to GGUF bf16 and quantised to q8_0 / q4_0; nanoqwen int8 and int4 are made at load "
            f"from the same bf16 checkpoint. {os.cpu_count()} threads for both.\n\n"
            f"{bench_model.machine_line('cpu')}\n\n" + table(results, results["ceilings"]))
    print(body)
    if args.write:
        # a llama.cpp built without AVX-512 (an AVX2-only build, for a like-for-like AVX2 comparison) gets its
        # own table beside the native build's
        suffix = "" if "AVX512" in instructions else "-llama-avx2"
        bench_model.write_benchmarks(bench_model.section_name("bench_llamacpp", "cpu") + suffix, body)


if __name__ == "__main__":
    main()
