"""A/B of versions of nanoqwen's CPU kernels (nanoqwen/ops/cpu/csrc), decode step by decode step.

    cp -r nanoqwen/ops/cpu/csrc /tmp/try/csrc     # then edit /tmp/try/csrc
    python bench/ab_kernels.py nanoqwen/ops/cpu /tmp/try --quantization int4 --seconds 90

Each folder holds a csrc/ (the first is the baseline; name the repository's own as nanoqwen/ops/cpu). Each is built
as its own extension; one LLM decodes (batch 1, or --batch) with the versions taking turns step by step, each
step's decode_model call timed (worker/fused_decoder.py). Neighbouring steps see the same memory phase (this
machine's read bandwidth moves between levels for tens of seconds at a time), so the ratio of neighbouring steps'
times shows small differences that A/B runs seconds apart drown in noise (two identical builds read level; the
figures are in docs/tried-and-not-kept.md). Greedy tokens must be the same whichever version runs a step; the
script says if they are not. Long contexts: --prompt-len (each call processes the prompt anew, then 128 steps) and
--kv-cache-dtype (int8 etc.: the quantized cache's kernels).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (its checkpoint and prompts)


def build(folder: Path, name: str):
    """The extension built from folder/csrc/*.cpp, as nanoqwen/ops/cpu/kernels.py builds its own (ops/cpu/build.py),
    in a build folder of its own named `name`."""
    from nanoqwen.ops.cpu import build as cpu_build

    return cpu_build.build(folder / "csrc", Path("/tmp/nanoqwen-ab") / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="folders holding a csrc/ each; the first: baseline")
    parser.add_argument("--model", default=None, help=f"model folder (default: {bench_model.DEFAULT_DIR})")
    parser.add_argument("--quantization", choices=["none", "int8", "int4"], default="int4")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to keep decoding")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's type (EngineConfig.kv_cache_dtype)")
    args = parser.parse_args()
    if len(args.folders) < 2:
        parser.error("give at least two folders (the baseline first)")

    from nanoqwen import LLM, SamplingParams
    from nanoqwen.ops.cpu import kernels as cpu_kernels
    from nanoqwen.worker import fused_decoder as decode_step

    model_dir = Path(args.model) if args.model else bench_model.DEFAULT_DIR
    bench_model.ensure_checkpoint(model_dir)
    # No prefix caching: a repeated prompt would hit the cache and its first token come from a one-row product (the
    # gemv kernels) instead of the prompt's many-row one, another rounding of x in int8 (int16 activations against
    # bf16 ones), which flipped a near-tied first token and made identical builds read as "DIFFER".
    llm = LLM(str(model_dir), quantization=None if args.quantization == "none" else args.quantization,
              enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.llm_engine.runner
    if runner.fused_decoder is None:
        sys.exit("this engine does not decode through decode_model (worker/fused_decoder.py): nothing to compare")
    names = [f"v{i}_{f.resolve().name}".replace("-", "_") for i, f in enumerate(args.folders)]
    versions = {}
    for name, folder in zip(names, args.folders, strict=True):
        cpu_kernels._ext = build(folder, name)  # (FusedDecoder packs its weights for the extension in use)
        versions[name] = (cpu_kernels._ext, decode_step.FusedDecoder(runner.model))
    times: dict[str, list[float]] = collections.defaultdict(list)

    class TakingTurns:
        calls = 0

        def __call__(self, *inputs):
            name = names[self.calls % len(names)]
            self.calls += 1
            cpu_kernels._ext, decoder = versions[name]
            start = time.perf_counter()
            logits = decoder(*inputs)
            times[name].append(time.perf_counter() - start)
            return logits

    runner.fused_decoder = TakingTurns()
    prompt = [{"prompt_token_ids": p} for p in bench_model.prompts(args.batch, args.prompt_len)]
    params = SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True)
    def tokens() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompt, params, use_tqdm=False)]

    expected = tokens()
    times.clear()
    end, same = time.time() + args.seconds, True
    while time.time() < end:  # (128 decode steps a call; the turns go on from call to call)
        same &= tokens() == expected
    if len(times) < len(names):
        sys.exit("no decode step went through decode_model (a batch over the gemv kernels' rows?): nothing timed")
    pairs = min(len(t) for t in times.values())
    for name in names:
        print(f"{name}: {len(times[name])} steps, median {statistics.median(times[name]) * 1e3:.3f} ms")
    for name in names[1:]:
        speed = sorted(a / b for a, b in zip(times[names[0]][:pairs], times[name][:pairs], strict=True))
        print(f"{name} / {names[0]}, speed: median {statistics.median(speed):.3f} (quartiles "
              f"{speed[len(speed) // 4]:.3f}-{speed[3 * len(speed) // 4]:.3f}), {pairs} pairs of neighbouring steps")
    print("greedy tokens: the same in every call" if same else "greedy tokens DIFFER between versions")


if __name__ == "__main__":
    main()
