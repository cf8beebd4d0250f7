"""Loading a checkpoint: time, peak memory and the weights it ends with, then batch-1 decode speed.

    python bench/bench_load.py --model DIR --quantization int8
    python bench/bench_load.py --model DIR                  # the checkpoint's own dtype (bf16)

Made to show what int8 loading buys: the loader quantises each matrix as soon as it is filled, so a model whose
bf16 weights exceed the machine's memory loads when its int8 weights fit (e.g. Qwen3-14B, 29.5 GB in bf16, on a
24 GiB machine). Peak memory is the process's max RSS (VmHWM) from just before loading.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def status(key: str) -> int:
    """A /proc/self/status memory figure in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder")
    parser.add_argument("--quantization", default=None, choices=["int8"])
    parser.add_argument("--tokens", type=int, default=16, help="tokens decoded at batch 1")
    args = parser.parse_args()

    from nanoqwen import LLM, SamplingParams

    files = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again here, after the imports
    before, start = status("VmRSS"), time.perf_counter()
    llm = LLM(args.model, dtype="bfloat16", device="cpu", max_model_len=256, kv_cache_memory=64 << 20,
              quantization=args.quantization, enforce_eager=True)
    load_s, peak = time.perf_counter() - start, status("VmHWM") - before

    prompt = [[1000 + 7 * i for i in range(16)]]

    def decode(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    decode(2)  # warm-up
    first, full = decode(1), decode(1 + args.tokens)
    print(json.dumps({"checkpoint_gb": round(files / 1e9, 2), "quantization": args.quantization or "none",
                      "load_s": round(load_s, 1), "load_peak_rss_gb": round(peak / 1e9, 2),
                      "weights_gb": round(llm.llm_engine.weight_bytes / 1e9, 2),
                      "decode_b1_tok_s": round(args.tokens / (full - first), 2)}))


if __name__ == "__main__":
    main()
