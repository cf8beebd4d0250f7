"""A checkpoint's safetensors files: which they are, and reading their tensors (or this rank's part
of each) through safetensors' memory map without holding more than a group of them at once.
loader.py decides where each tensor goes."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from nanoqwen.config.model import read_json
from nanoqwen.errors import WeightsError


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a folder: the shards an index lists, or the single model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index} has no 'weight_map' object")
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{model_dir} has no model.safetensors "
                           "(or model.safetensors.index.json)")
    for f in files:
        if not f.is_file():
            raise WeightsError(f"{f} is listed in model.safetensors.index.json but missing")
    return files


# The part of a checkpoint tensor to read: (dimension, [(start, end), ...]), the ranges
# concatenated in order
Part = tuple[int, list[tuple[int, int]]]
# (name, full shape) -> the part to read, None to skip it
Plan = Callable[[str, tuple[int, ...]], Part | None]


def iter_checkpoint(files: list[Path], group_bytes: int = 128 << 20, plan: Plan | None = None
                    ) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(name, first row, rows) pieces of every tensor, read through safetensors' memory map.

    `plan` picks the part of each tensor to read (default: all of it); rows count within that part.
    Pages of a memory map count as the process's memory until the map is closed, so the file is
    reopened every `group_bytes` and big tensors are read in row blocks: loading never holds
    more than the parameters plus one group.
    """
    for f in files:
        with _reading(f):
            with safe_open(f, framework="pt", device="cpu") as st:
                shapes = {name: (tuple(st.get_slice(name).get_shape()),
                                 st.get_slice(name).get_dtype())
                          for name in st.keys()}
            # (name, first row, end row, its row in the part, (dim, ranges) or None, bytes)
            pieces = []
            for name, (shape, dtype) in shapes.items():
                if not shape:  # a scalar: read whole (plan still checks that it has a place)
                    if plan is None or plan(name, shape) is not None:
                        pieces.append((name, 0, 1, 0, None, _DTYPE_BYTES.get(dtype, 4)))
                    continue
                part = plan(name, shape) if plan is not None else (0, [(0, shape[0])])
                if part is None:
                    continue
                dim, ranges = part
                row_bytes = _DTYPE_BYTES.get(dtype, 4) * math.prod(shape[1:])
                if dim > 0:  # a row holds only the ranges' share of dimension `dim`
                    row_bytes = row_bytes // shape[dim] * sum(end - start for start, end in ranges)
                row_ranges = ranges if dim == 0 else [(0, shape[0])]
                done = 0  # rows of the part before this range
                for first, last in row_ranges:
                    step = (max(1, group_bytes // max(row_bytes, 1)) if len(shape) > 1
                            else last - first)
                    pieces += [(name, r, min(r + step, last), done + r - first, (dim, ranges),
                                row_bytes * (min(r + step, last) - r))
                               for r in range(first, last, step)]
                    done += last - first
            while pieces:
                group, total = [], 0
                while pieces and (not group or total + pieces[0][5] <= group_bytes):
                    total += pieces[0][5]
                    group.append(pieces.pop(0))
                with safe_open(f, framework="pt", device="cpu") as st:
                    for name, start, end, row, cut, _ in group:
                        if cut is None:
                            yield name, 0, st.get_tensor(name)
                        elif cut[0] == 0:
                            yield name, row, st.get_slice(name)[start:end]
                        else:
                            dim, ranges = cut
                            # e.g. [rows, :, a:b]
                            lead = (slice(start, end), *[slice(None)] * (dim - 1))
                            reads = [st.get_slice(name)[(*lead, slice(a, b))] for a, b in ranges]
                            yield name, row, (reads[0] if len(reads) == 1
                                              else torch.cat(reads, dim=dim))


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1}


@contextlib.contextmanager
def _reading(file: Path) -> Iterator[None]:
    """Turn safetensors' errors for a truncated or corrupt file into a WeightsError naming it."""
    try:
        yield
    except (OSError, ValueError) as e:
        raise WeightsError(f"{file} is not a readable safetensors file ({e}); "
                           "re-download it") from None
    except Exception as e:  # safetensors_rust.SafetensorError derives from Exception only
        if type(e).__name__ != "SafetensorError":
            raise
        raise WeightsError(f"{file} is truncated or corrupt ({e}); re-download it") from None


def write_index(model_dir: Path, shards: dict[str, list[str]], total_size: int) -> None:
    """Write model.safetensors.index.json for shards {file name: [tensor names]}."""
    weight_map = {name: file for file, names in shards.items() for name in names}
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
