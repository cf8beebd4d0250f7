"""Which device and dtype to run on, from the user's choice and the checkpoint's."""

from __future__ import annotations

import torch

from nanoqwen.errors import ConfigError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """cuda when available unless told otherwise."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device {device!r} is not a device; use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device.type!r} is not supported; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but torch sees no CUDA GPU; "
                          "use --device cpu")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, checkpoint_dtype: str,
                  device: torch.device) -> torch.dtype:
    """The checkpoint's dtype on GPU; bfloat16 on CPU (fast there with AMX/AVX-512), unless
    asked."""
    if dtype is None or dtype == "auto":
        return DTYPES[checkpoint_dtype] if device.type == "cuda" else torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
