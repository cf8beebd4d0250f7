"""What LoRA adapters cost a decode step (nanoqwen/lora/, docs/lora.md): the base model against rank-16 adapters on
all seven projections (q/k/v/o, gate/up/down), at batch 1 and at batch 16 spread over 4 adapters.

    python bench/bench_lora.py                   # random Qwen3-0.6B-shaped checkpoint, bf16, CPU
    python bench/bench_lora.py --device cuda

Rows (each the median decode step after a --prompt-len prompt, --steps steps a run, --repeats runs):
- base: an engine without enable_lora (on CPU its decode steps run the fused C++ decoder, worker/fused_decoder.py);
- base, lora engine: the same requests on an engine with enable_lora (the hooks are there, no adapter runs);
- base, per-module: the lora engine's base requests with the fused decoder off: the path a step of mixed
  adapters takes (and, on a GPU, every adapter step: CUDA graphs compute the base model only);
- adapter: every request with one rank-16 adapter (one slot for all rows: x @ A^T @ B; on CPU in the fused
  decoder, where it runs);
- adapter, per-module: the same with the fused decoder off (the hooks' one-slot path);
- 4 adapters: the batch's requests spread over 4 adapters (the batched matmuls over all slots, per-module).
The ratio column compares each row with the base row of its batch size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (its checkpoint and machine line)

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A random LoRA adapter in PEFT's format (what save_pretrained writes) for the checkpoint: every layer's
    seven projections, rank `rank`, alpha 2 * rank."""
    import torch
    from safetensors.torch import save_file

    from nanoqwen.lora.peft import module_shape
    from nanoqwen.model_loader.loader import load_config

    config = load_config(model_dir)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in SEVEN:
            block = "self_attn" if module in SEVEN[:4] else "mlp"
            in_f, out_f = module_shape(config, module)
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * in_f**-0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": SEVEN, "bias": "none"}))
    return out


def step_ms(llm, batch: int, lora, steps: int, repeats: int, prompt_len: int) -> float:
    """The median ms of a decode step of `batch` greedy sequences (lora: None, one LoRARequest for all, or one per
    sequence), each step timed on its own once every sequence has its first token (robust to a busy machine)."""
    import statistics

    from nanoqwen import SamplingParams

    engine = llm.llm_engine
    loras = lora if isinstance(lora, list) else [lora] * batch
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    times: list[float] = []
    for r in range(repeats + 1):  # (the first run warms up)
        for i, prompt in enumerate(bench_model.prompts(batch, prompt_len)):
            extra = {"lora_request": loras[i]} if loras[i] is not None else {}
            engine.add_request(f"bench-{r}-{i}", prompt, params, **extra)
        started: set[str] = set()
        while engine.has_unfinished_requests():
            decoding = len(started) == batch
            t = time.perf_counter()
            outs = engine.step()
            if decoding and r > 0:
                times.append(time.perf_counter() - t)
            started |= {o.request_id for o in outs if o.outputs[0].token_ids}
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"model folder (default: a random one in {bench_model.DEFAULT_DIR})")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else bench_model.DEFAULT_DIR
    bench_model.ensure_checkpoint(model_dir)
    from nanoqwen import LLM, LoRARequest

    adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(model_dir, model_dir.parent / f"lora-r{args.rank}-{i}",
                                                                args.rank, i))) for i in range(4)]
    options = dict(dtype="bfloat16", device=args.device, max_model_len=args.prompt_len + args.steps + 64,
                   enable_prefix_caching=False)
    print(bench_model.machine_line(args.device))
    timing = (args.steps, args.repeats, args.prompt_len)
    rows: list[tuple[str, int, float]] = []
    base = LLM(str(model_dir), **options)
    for b in (1, args.batch):
        rows.append(("base", b, step_ms(base, b, None, *timing)))
    del base
    llm = LLM(str(model_dir), enable_lora=True, max_loras=4, max_lora_rank=args.rank, **options)
    runner = llm.llm_engine.runner
    for b in (1, args.batch):
        rows.append(("base, lora engine", b, step_ms(llm, b, None, *timing)))
        if runner.fused_decoder is not None:
            fused, runner.fused_decoder = runner.fused_decoder, None
            rows.append(("base, per-module", b, step_ms(llm, b, None, *timing)))
            runner.fused_decoder = fused
        rows.append((f"adapter (rank {args.rank}, 7 projections)", b, step_ms(llm, b, adapters[0], *timing)))
        if runner.fused_decoder is not None:
            fused, runner.fused_decoder = runner.fused_decoder, None
            rows.append((f"adapter, per-module (rank {args.rank})", b, step_ms(llm, b, adapters[0], *timing)))
            runner.fused_decoder = fused
    spread = [adapters[i % 4] for i in range(args.batch)]
    rows.append((f"4 adapters (rank {args.rank}, 7 projections)", args.batch,
                 step_ms(llm, args.batch, spread, *timing)))
    base_ms = {b: ms for name, b, ms in rows if name == "base"}
    print("| configuration | batch | ms/step | vs base |\n|---|---|---|---|")
    for name, b, ms in rows:
        print(f"| {name} | {b} | {ms:.2f} | {ms / base_ms[b]:.2f}x |")


if __name__ == "__main__":
    main()
