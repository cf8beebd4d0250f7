"""From a model folder to a model on its device: read the config, load the weights (nanoqwen/model_loader/hub.py
finds the folder; nanoqwen/model_loader/weight_files.py reads its safetensors files).

Weights are read from model.safetensors or a sharded model.safetensors.index.json through
safetensors' memory map, one tensor at a time, and copied straight into parameters that were
allocated once on the target device in the target dtype. Peak memory therefore stays near the
size of the weights: there is never a second full copy.

With tensor parallelism each rank reads only its slices (each module's `tp_dims` in models/qwen3.py
says which dimension of which parameter is cut), through safetensors' sliced reads: a rank's memory
is about 1/N of the weights.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from nanoqwen.config.model import GenerationConfig, Qwen3Config, read_json
from nanoqwen.config.quantization import CHECKPOINT_METHODS
from nanoqwen.errors import ConfigError, WeightsError
from nanoqwen.model_loader.gguf import load_gguf_weights
from nanoqwen.model_loader.gguf_file import GGUFCheckpoint, is_gguf, type_name
from nanoqwen.model_loader.prequantized import checkpoint_quantization, is_quantized_tensor, load_prequantized
from nanoqwen.model_loader.sharding import tp_split_dim
from nanoqwen.model_loader.weight_files import Part, iter_checkpoint, safetensors_files
from nanoqwen.models.qwen3 import PLAIN_KERNELS, Kernels, Qwen3ForCausalLM
from nanoqwen.ops.gguf_quants import FLOAT_TYPES
from nanoqwen.quantization import check_quantization, quantize_model, quantize_module
from nanoqwen.tokenizer import Tokenizer

PROGRESS_BAR_MIN_BYTES = 1 << 30  # show a loading bar for checkpoints of 1 GiB and more

# checkpoint name (after "model.layers.{i}.") -> (our parameter, index of its slice in a stacked
# matrix); every other tensor keeps its checkpoint name without the "model." prefix.
STACKED_PARAMS = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}
# MoE experts. The official checkpoints store each expert's matrices
# ("mlp.experts.{j}.gate_proj.weight" [Ie, H], up_proj [Ie, H], down_proj [H, Ie]); they fill slice
# (j, half) of our stacked parameters (half None: the whole expert). transformers 5's own parameter
# names ("mlp.experts.gate_up_proj" [E, 2Ie, H], gate rows then up rows, and "mlp.experts.down_proj"
# [E, H, Ie]) are ours, loaded as they are.
EXPERT_TENSOR = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
EXPERT_PARAMS = {"gate": ("mlp.experts.gate_up_proj", 0), "up": ("mlp.experts.gate_up_proj", 1),
                 "down": ("mlp.experts.down_proj", None)}
# A checkpoint saved from the bare decoder (transformers' Qwen3Model, as Qwen3-Embedding is) names
# its tensors without the "model." prefix.
BARE_PREFIXES = ("embed_tokens.", "layers.", "norm.")
# a slice of a stacked q/k/v or gate/up matrix, or of the experts
Shard = int | tuple[int, int | None] | None

# Tensor parallelism: the model's modules say which dimension of each parameter is cut into N equal
# slices (`tp_dims`), rank r holding slice r. A stacked parameter is cut part by part, so rank r
# holds [q_r; k_r; v_r] and [gate_r; up_r]: each checkpoint tensor is sliced on its own and copied
# into the rank's part. A checkpoint tensor's dimensions line up with the trailing ones of its
# parameter (an expert's [Ie, H] gate_proj fills a [2Ie, H] slice of the [E, 2Ie, H] experts).
# Parameters no module cuts (the norms, the MoE router) are read whole by every rank.


def load_config(model_dir: Path) -> Qwen3Config:
    """The model's config: config.json of a folder, or a GGUF file's metadata."""
    if is_gguf(model_dir):
        return GGUFCheckpoint(model_dir).config()
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"{model_dir} has no config.json: is this a Qwen3 model folder?")
    return Qwen3Config.from_file(model_dir / "config.json")


def load_generation_config(model_dir: Path, fallback_eos: list[int]) -> GenerationConfig:
    """generation_config.json of a folder (fallback_eos where it has none), or a GGUF file's sampling metadata."""
    if is_gguf(model_dir):
        return GGUFCheckpoint(model_dir).generation_config()
    return GenerationConfig.from_file(model_dir / "generation_config.json", fallback_eos=fallback_eos)


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The tokenizer of a folder (tokenizer.json and its config), or one rebuilt from a GGUF file's metadata."""
    if is_gguf(model_dir):
        return GGUFCheckpoint(model_dir).tokenizer()
    return Tokenizer.from_pretrained(model_dir)


def checkpoint_to_param(name: str) -> tuple[str, Shard] | None:
    """Our parameter name (and stacked slice) for a checkpoint tensor name;
    None if it has no place."""
    if name == "lm_head.weight":
        return name, None
    if name.startswith("model."):
        name = name[len("model."):]
    elif not name.startswith(BARE_PREFIXES):
        return None
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in STACKED_PARAMS:
        param, shard = STACKED_PARAMS[parts[2]]
        return f"layers.{parts[1]}.{param}", shard
    if len(parts) == 3 and parts[0] == "layers" and (m := EXPERT_TENSOR.fullmatch(parts[2])):
        param, half = EXPERT_PARAMS[m[2]]
        return f"layers.{parts[1]}.{param}", (int(m[1]), half)
    return name, None


def _slice(param: torch.Tensor, model: Qwen3ForCausalLM, name: str, shard: Shard) -> torch.Tensor:
    """The part of `param` that checkpoint tensor `shard` fills (the whole
    tensor when not stacked)."""
    if shard is None:
        return param
    if isinstance(shard, tuple):  # expert j of the stacked experts; half 0/1: its gate or up rows
        expert, half = shard
        if half is None:
            return param[expert]
        return param[expert].narrow(0, half * (param.shape[1] // 2), param.shape[1] // 2)
    # a ColumnParallelLinear's parts
    sizes = model.get_submodule(name.rpartition(".")[0]).output_sizes
    start = sum(sizes[:shard])
    return param.narrow(0, start, sizes[shard])


def load_weights(model: Qwen3ForCausalLM, files: list[Path], show_progress: bool | None = None,
                 on_module_loaded: Callable[[str], None] | None = None,
                 skip: Callable[[str], bool] | None = None) -> None:
    """Copy every checkpoint tensor (this rank's slice of it) into its parameter; error on missing,
    unexpected or misshaped ones.

    on_module_loaded(name) is called as soon as every parameter of module `name` is filled (int8
    quantises it there, so on CPU the model-dtype copy of the whole model never exists: the
    pages of a parameter not filled yet are not committed; a GPU allocates them all when the
    model is built). The loader drops its own references to that module's parameters first;
    nothing is written to them after. skip(name): checkpoint tensors read elsewhere (not loaded here).
    """
    params = dict(model.named_parameters())
    expected = list(_expected_slices(model))
    loaded: set[tuple[str, Shard]] = set()
    rank, size = model.tp_rank, model.tp_size
    # checkpoint name -> (target, where)
    dests: dict[str, tuple[tuple[str, Shard], torch.Tensor]] = {}
    rows_left: dict[str, int] = {}  # checkpoint name -> rows not copied yet
    unfilled: dict[str, set[tuple[str, Shard]]] = {}  # module name -> its slices not filled yet
    for param, shard in expected:
        unfilled.setdefault(param.rpartition(".")[0], set()).add((param, shard))

    def plan(ckpt_name: str, shape: tuple[int, ...]) -> Part | None:
        """Check a checkpoint tensor against its parameter and pick this rank's part of it."""
        if ckpt_name == "lm_head.weight" and model.lm_head is None:
            return None  # loaded without a head (an embedding model): a stored one is not needed
        if skip is not None and skip(ckpt_name):
            return None  # read already (a quantised checkpoint's own matrices: model_loader/prequantized.py)
        if ckpt_name == "lm_head.weight" and model.is_tied:
            # A tied config whose file also stores the head: load it, and share the embedding
            # again below if the two are equal (transformers unties them when they differ).
            model.lm_head.weight = params["lm_head.weight"] = torch.nn.Parameter(
                torch.empty_like(model.embed_tokens.weight), requires_grad=False)
        target = checkpoint_to_param(ckpt_name)
        if (target is not None and target[0] not in params and _rank0_only(model, target[0])
                and rank > 0):
            return None
        if target is None or target[0] not in params or (
                isinstance(target[1], tuple) and target[1][0] >= params[target[0]].shape[0]):
            raise WeightsError(f"unexpected tensor {ckpt_name!r} in the checkpoint: "
                               f"it has no place in a Qwen3 model with this config.json")
        param = params[target[0]]
        dest = _slice(param, model, target[0], target[1])
        dim = tp_split_dim(model, target[0], dest.dim()) if size > 1 else None
        full = list(dest.shape)
        if dim is not None:
            full[dim] *= size
        if tuple(full) != shape:
            raise WeightsError(f"tensor {ckpt_name!r} has shape {list(shape)} in the checkpoint, "
                               f"but config.json implies {full}")
        dests[ckpt_name] = target, dest
        rows_left[ckpt_name] = dest.shape[0]
        if dim is None:
            return 0, [(0, shape[0])]
        # this rank's slice of each stacked part (one part, unless the tensor fills a whole
        # stacked parameter)
        module_name, _, leaf = target[0].rpartition(".")
        fused_parts = getattr(model.get_submodule(module_name), "tp_fused_parts", {})
        parts = fused_parts.get(leaf, 1) if target[1] is None else 1
        local, whole = dest.shape[dim] // parts, shape[dim] // parts
        return dim, [(p * whole + rank * local, p * whole + (rank + 1) * local)
                     for p in range(parts)]

    total = sum(f.stat().st_size for f in files) // size  # about what this rank reads
    if show_progress is None:
        show_progress = total >= PROGRESS_BAR_MIN_BYTES
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights",
               disable=not show_progress)
    with bar, torch.no_grad():
        for ckpt_name, first_row, rows in iter_checkpoint(files, plan=plan):
            target, dest = dests[ckpt_name]
            dest[first_row: first_row + rows.shape[0]].copy_(rows)
            bar.update(rows.numel() * rows.element_size())
            rows_left[ckpt_name] -= rows.shape[0]
            if rows_left[ckpt_name] > 0:
                continue
            filled = {target}
            if (target[0].endswith(("experts.gate_up_proj", "experts.down_proj"))
                    and target[1] is None):
                # a fused tensor fills every expert
                filled.update(_expert_slices(target[0], dest.shape[0]))
            loaded.update(filled)
            del dests[ckpt_name], dest
            module = target[0].rpartition(".")[0]
            left = unfilled.get(module)
            if left is not None:
                left -= filled
                if not left and on_module_loaded is not None:
                    del unfilled[module]
                    for name in [n for n in params if n.rpartition(".")[0] == module]:
                        del params[name]
                    on_module_loaded(module)
    missing = [s for s in expected if s not in loaded]  # in the model's order
    if missing:
        names = [_checkpoint_name(n, s) for n, s in missing]
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        stacked = (f" (or the stacked 'model.{missing[0][0]}')"
                   if isinstance(missing[0][1], tuple) else "")
        raise WeightsError(f"tensor {names[0]!r}{stacked} is missing from the checkpoint "
                           f"(missing: {', '.join(names[:5])}{more})")
    if (model.config.tie_word_embeddings and model.lm_head is not None and not model.is_tied
            and torch.equal(model.lm_head.weight, model.embed_tokens.weight)):
        model.lm_head.weight = model.embed_tokens.weight


def _rank0_only(model: torch.nn.Module, param: str) -> bool:
    """Whether the parameter exists on rank 0 only (a row-parallel bias):
    the other ranks skip it."""
    module_name, _, leaf = param.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    return leaf in getattr(module, "tp_rank0_only", ())


def _expected_slices(model: Qwen3ForCausalLM) -> Iterator[tuple[str, Shard]]:
    """(parameter, stacked slice) pairs that the checkpoint must fill."""
    for name, param in model.named_parameters():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            yield from ((name, i) for i in range(3))
        elif name.endswith("gate_up_proj.weight"):
            yield from ((name, i) for i in range(2))
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            yield from _expert_slices(name, param.shape[0])
        else:
            yield name, None


def _expert_slices(param: str, num_experts: int) -> list[tuple[str, Shard]]:
    """The per-expert checkpoint tensors that fill a stacked expert parameter, expert by expert."""
    halves = (0, 1) if param.endswith("gate_up_proj") else (None,)
    return [(param, (j, half)) for j in range(num_experts) for half in halves]


def _checkpoint_name(param: str, shard: Shard) -> str:
    """The checkpoint tensor name for one of our parameters (for error messages)."""
    if param == "lm_head.weight":
        return param
    if isinstance(shard, tuple):
        kind = next(k for k, (ours, half) in EXPERT_PARAMS.items()
                    if param.endswith(ours) and half == shard[1])
        return f"model.{param.rsplit('.', 2)[0]}.experts.{shard[0]}.{kind}_proj.weight"
    for ckpt, (ours, s) in STACKED_PARAMS.items():
        if param.endswith(ours) and s == shard:
            return f"model.{param[: -len(ours)]}{ckpt}"
    return f"model.{param}"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_dir: Path, config: Qwen3Config, dtype: torch.dtype, device: torch.device,
               max_model_len: int | None = None, tp_rank: int = 0, tp_size: int = 1,
               show_progress: bool | None = None, quantization: str | None = None,
               task: str = "generate", kernels: Kernels = PLAIN_KERNELS) -> Qwen3ForCausalLM:
    """Build the model (this rank's shard of it) with uninitialised parameters on `device` in
    `dtype`, then fill them from disk. quantization="int8"/"int4": each matrix is quantised as soon
    as it is filled, so (on CPU) memory peaks near the quantised model, not the model-dtype one; the
    LM head last (a tied head is settled at the end).

    task="embed": no LM head; "score": the head stays unquantised (a reranker reads two of its rows:
    nanoqwen/layers/pooler.py). kernels: what the model computes with (the plain functions by default;
    an engine's choice: nanoqwen/worker/kernel_selection.py)."""
    if is_gguf(model_dir):
        return load_gguf_model(model_dir, config, dtype, device, max_model_len, tp_rank, tp_size, quantization,
                               task, kernels)
    elif quantization == "gguf":
        raise ConfigError(f"--quantization gguf: {model_dir} is not a GGUF file")
    files = safetensors_files(model_dir)
    own = checkpoint_quantization(read_json(model_dir / "config.json"), model_dir / "config.json")
    if own is not None:
        return load_prequantized_model(model_dir, files, own, config, dtype, device, max_model_len, tp_rank,
                                       tp_size, quantization, task, kernels, show_progress)
    if quantization in CHECKPOINT_METHODS:
        raise ConfigError(f"--quantization {quantization}: {model_dir} is not quantized with {quantization.upper()} "
                          f"(its config.json has no quantization_config with quant_method {quantization}); leave "
                          "the flag out, or use int8 / int4")
    with _default_dtype(dtype), torch.device(device):
        model = Qwen3ForCausalLM(config, max_model_len, tp_rank, tp_size, lm_head=task != "embed",
                                 kernels=kernels)
    on_loaded = None
    if check_quantization(quantization) is not None:
        def on_loaded(name: str) -> None:
            if name != "lm_head":
                quantize_module(model, name, quantization)
    load_weights(model, files, show_progress, on_loaded)
    if task == "generate":
        quantize_model(model, quantization)  # what is left: the LM head
    return model.eval()


def load_gguf_model(path: Path, config: Qwen3Config, dtype: torch.dtype, device: torch.device,
                    max_model_len: int | None, tp_rank: int, tp_size: int, quantization: str | None, task: str,
                    kernels: Kernels) -> Qwen3ForCausalLM:
    """load_model for a GGUF file (nanoqwen/model_loader/gguf.py): its quantised matrices kept as the file holds
    them (this rank's rows or columns of them); quantization applies only to a file of float matrices."""
    if quantization in CHECKPOINT_METHODS and quantization != "gguf":
        raise ConfigError(f"--quantization {quantization}: {path} is a GGUF file, not quantized with "
                          f"{quantization.upper()}; leave the flag out (or pass --quantization gguf)")
    ckpt = GGUFCheckpoint(path)
    kinds = sorted({type_name(t.ggml_type) for t in ckpt.tensors.values()
                    if len(t.shape) > 1 and t.ggml_type not in FLOAT_TYPES})
    if kinds and check_quantization(quantization) is not None:
        raise ConfigError(f"--model {path} is already quantized ({', '.join(kinds)}): leave out "
                          f"--quantization {quantization} (nanoqwen computes with the file's own weights)")
    with _default_dtype(dtype), torch.device("cpu"):  # (parameters left unwritten are never committed)
        model = Qwen3ForCausalLM(config, max_model_len, tp_rank, tp_size, lm_head=task != "embed", kernels=kernels)
    load_gguf_weights(model, ckpt)
    ckpt.close()
    if check_quantization(quantization) is not None:  # a file of float matrices: as load_model quantises
        for name in [n for n, _ in model.named_modules() if n and n.partition(".")[0] != "lm_head"]:
            quantize_module(model, name, quantization)
        if task == "generate":
            quantize_model(model, quantization)  # the LM head
    return model.to(device).eval()


def load_prequantized_model(model_dir: Path, files: list[Path], own: dict, config: Qwen3Config, dtype: torch.dtype,
                            device: torch.device, max_model_len: int | None, tp_rank: int, tp_size: int,
                            quantization: str | None, task: str, kernels: Kernels,
                            show_progress: bool | None) -> Qwen3ForCausalLM:
    """load_model for an AWQ, GPTQ or FP8 checkpoint (nanoqwen/model_loader/prequantized.py): its quantised
    projections held as they are (this rank's rows or columns of them), the rest loaded as usual."""
    method = own["quant_method"]
    if quantization not in (None, method):
        raise ConfigError(f"--model {model_dir} is already quantized ({method}): leave out --quantization "
                          f"{quantization} (or pass --quantization {method})")
    with _default_dtype(dtype), torch.device("cpu"):  # (parameters replaced before they are written: never committed)
        model = Qwen3ForCausalLM(config, max_model_len, tp_rank, tp_size, lm_head=task != "embed", kernels=kernels)
    load_prequantized(model, files, own)
    load_weights(model, files, show_progress, skip=lambda name: is_quantized_tensor(name, method))
    return model.to(device).eval()
