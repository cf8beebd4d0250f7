"""Quantised checkpoints for the tests, packed here from known integers as each format's own tools lay them out
(AutoAWQ's GEMM packing with its interleaved column order; AutoGPTQ's input-packed qweight with zeros stored minus
one, act order's g_idx; Qwen's FP8 blocks), beside a float32 folder of the same weights for transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of each int32 holds column 8c + AWQ_PACK_ORDER[i]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED_INPUT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}


def pack_int32(values: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """[rows, 8c] values in 0..15 -> [rows, c] int32, nibble i of word c holding column 8c + order[i]."""
    rows, cols = values.shape
    order = order or list(range(8))
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, column in enumerate(order):
        out |= values[:, column::8].long() << (4 * i)
    return out.to(torch.int32) if out.max() < 2**31 else (out - (out >= 2**31).long() * 2**32).to(torch.int32)


def awq_tensors(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """W [N, K] = (q - zero) * scale per group, as AutoAWQ's GEMM layout stores it."""
    return {"qweight": pack_int32(q.T.contiguous(), AWQ_PACK_ORDER), "qzeros": pack_int32(zero.T.contiguous(),
                                                                                          AWQ_PACK_ORDER),
            "scales": scale.T.contiguous().half()}


def gptq_tensors(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, g_idx: torch.Tensor
                 ) -> dict[str, torch.Tensor]:
    """W[n, k] = (q[n, k] - zero[n, g_idx[k]]) * scale[n, g_idx[k]] as AutoGPTQ stores it: qweight packs 8
    consecutive inputs, qzeros 8 outputs, zeros minus one."""
    qweight = pack_int32(q.contiguous()).T.contiguous()  # [K/8, N]: input 8r + i in nibble i of row r
    return {"qweight": qweight, "qzeros": pack_int32((zero.T - 1).contiguous()), "scales": scale.T.contiguous().half(),
            "g_idx": g_idx.to(torch.int32)}


def write_quantized(src: Path, out: Path, method: str, act_order: bool = False, group: int = 128, seed: int = 0,
                    symmetric: bool = False) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(the quantised checkpoint, a float32 folder of its weights, {projection name: its known integers q [N, K]})
    from the random float checkpoint `src` (its embedding, norms and head are kept). symmetric (GPTQ's `sym`): every
    zero point 8."""
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    quantized, reference, known = {}, {}, {}
    orders: dict[tuple[str, str], torch.Tensor] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if not (parts[-1] == "weight" and len(parts) >= 2 and parts[-2] in PROJECTIONS):
            quantized[name] = tensor
            reference[name] = tensor.float()
            continue
        prefix = name.removesuffix(".weight")
        n, k = tensor.shape
        if method == "fp8":
            w8 = (torch.randn(n, k, generator=g) * 100).to(torch.float8_e4m3fn)
            scale_inv = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 1e-3 + 2e-4
            quantized[f"{prefix}.weight"], quantized[f"{prefix}.weight_scale_inv"] = w8, scale_inv
            full = scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            reference[name] = w8.float() * full
            continue
        q = torch.randint(0, 16, (n, k), generator=g)
        zero = torch.randint(int(method == "gptq"), 16, (n, k // group), generator=g)  # (GPTQ stores zero - 1)
        if symmetric:
            zero = torch.full_like(zero, 8)
        scale = (torch.rand(n, k // group, generator=g) * 0.01 + 0.005).half()
        known[prefix] = q
        if method == "awq":
            quantized.update({f"{prefix}.{leaf}": t for leaf, t in awq_tensors(q, zero, scale).items()})
            groups = torch.arange(k) // group
        else:
            key = (parts[2], SHARED_INPUT.get(parts[-2], parts[-2]))  # one act order per layer input
            if act_order and key not in orders:
                orders[key] = torch.randperm(k, generator=g)
            groups = (orders[key].argsort() // group) if act_order else torch.arange(k) // group
            quantized.update({f"{prefix}.{leaf}": t for leaf, t in gptq_tensors(q, zero, scale, groups).items()})
        reference[name] = (q - zero[:, groups]).float() * scale[:, groups].float()
    qconfig = {"awq": {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True},
               "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": symmetric,
                        "checkpoint_format": "gptq"},
               "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}}[method]
    for folder, weights, extra in ((out, quantized, {"quantization_config": qconfig}), (out / "reference", reference,
                                                                                        {"torch_dtype": "float32"})):
        folder.mkdir(parents=True, exist_ok=True)
        save_file(weights, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (src / f).exists():
                shutil.copy(src / f, folder / f)
    return out, out / "reference", known
