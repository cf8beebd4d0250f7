"""Where a decode step's time goes on a GPU: host and GPU shares of each phase, kernels a step, the costliest kernels.

    python bench/gpu_profile.py                  # the random Qwen3-0.6B-shaped checkpoint, with graphs and eager
    python bench/gpu_profile.py --device cpu --model DIR   # a dry run of this script (no GPU kernels to count)

For each mode (CUDA graphs; --enforce-eager), on one LLM:
- a 512-token prefill, 10 calls (min / median / max), and the batch-1 and batch-16 decode step (128 steps after
  32-token prompts, best of 3);
- the batch-1 step split into its phases (scheduler, packing, forward, sampling, postprocess; the graph's
  replay on its own): host times first, then with the forward and the sampler synchronised, so that their
  figures hold the GPU's share;
- torch.profiler over 8 batch-1 steps: GPU kernels a step (the profile of a 1-token call taken from that of a
  9-token one), and the kernels with the most GPU time.
bench/gpu.sh runs it as its `profile` stage; BENCHMARKS.md's GPU section reads such a run.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (its checkpoint and prompts)

from nanoqwen import LLM, SamplingParams  # noqa: E402
from nanoqwen.worker import model_runner

STEPS = 128


def timings(fn: Callable[[], object], n: int, sync: Callable[[], None]) -> list[float]:
    """Seconds of n calls after a warm-up, sorted."""
    fn()
    sync()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)


class PhaseTimer:
    """Wraps methods (on an instance, or a module's function) to add up the seconds spent in each; optionally
    synchronising the GPU before and after, so that the time holds the GPU work it started."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync, self.seconds, self._undo = sync, collections.Counter(), []

    def wrap(self, owner: object, name: str, label: str, synchronised: bool = False) -> None:
        original = getattr(owner, name)
        self._undo.append((owner, name, vars(owner).get(name)))

        def timed(*args, **kwargs):
            if synchronised:
                self.sync()
            start = time.perf_counter()
            result = original(*args, **kwargs)
            if synchronised:
                self.sync()
            self.seconds[label] += time.perf_counter() - start
            return result

        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, before in reversed(self._undo):
            if before is None:  # it was the class's method: drop the instance's wrapper
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self._undo.clear()


def gpu_kernels(prof) -> int:
    """GPU kernels (and copies) a profile saw."""
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def profile_mode(model_dir: str, device: str, eager: bool) -> None:
    name = "eager" if eager else "graphs"
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    llm = LLM(model_dir, dtype="bfloat16", device=device, max_model_len=1024, max_num_seqs=16,
              max_num_batched_tokens=8192, enable_prefix_caching=False, enforce_eager=eager)

    def gen(prompts: list[list[int]], n: int):
        return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    long_prompt, short = bench_model.prompts(1, 512), bench_model.prompts(16, 32)
    t = timings(lambda: gen(long_prompt, 1), 10, sync)
    print(f"{name}: 512-token prefill, ms min {t[0] * 1e3:.1f} median {statistics.median(t) * 1e3:.1f} "
          f"max {t[-1] * 1e3:.1f}", flush=True)
    for b in (1, 16):
        first = timings(lambda b=b: gen(short[:b], 1), 3, sync)[0]
        full = timings(lambda b=b: gen(short[:b], 1 + STEPS), 3, sync)[0]
        print(f"{name}: batch-{b} decode step {(full - first) / STEPS * 1e3:.3f} ms", flush=True)

    engine, runner = llm.llm_engine, llm.llm_engine.runner
    for synchronised in (False, True):
        timer = PhaseTimer(sync)
        timer.wrap(engine.scheduler, "schedule", "schedule")
        timer.wrap(runner, "prepare", "prepare")
        timer.wrap(runner, "forward", "forward", synchronised)
        if runner.graph_runner is not None:
            timer.wrap(runner.graph_runner, "run", "graph replay", synchronised)
        timer.wrap(model_runner, "sample", "sample", synchronised)
        timer.wrap(engine, "_postprocess", "postprocess")
        gen(short[:1], 1)
        timer.seconds.clear()
        start = time.perf_counter()
        gen(short[:1], 1 + STEPS)
        total = time.perf_counter() - start
        timer.restore()
        phases = ", ".join(f"{k} {v / STEPS * 1e3:.3f}" for k, v in timer.seconds.items())
        print(f"{name}: batch-1 phases, ms a step ({'synchronised' if synchronised else 'host'}): "
              f"all {total / STEPS * 1e3:.3f}: {phases}", flush=True)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    counts = {}
    for n in (1, 9):
        gen(short[:1], n)
        with profile(activities=activities) as prof:
            gen(short[:1], n)
        sync()
        counts[n] = gpu_kernels(prof)
    print(f"{name}: GPU kernels a batch-1 decode step: {(counts[9] - counts[1]) / 8:.0f} "
          f"({counts[1]} for the 32-token prompt)", flush=True)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=f"model folder (default: {bench_model.DEFAULT_DIR})")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of this script")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU: this profile needs one (--device cpu is a dry run)")
    model_dir = Path(args.model) if args.model else bench_model.DEFAULT_DIR
    bench_model.ensure_checkpoint(model_dir)
    for eager in (False, True):
        profile_mode(str(model_dir), args.device, eager)
        gc.collect()  # (the engine of the mode before, its KV cache with it)
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
