"""This CPU's model name and the feature flags that decide which kernels it can run and how fast."""

from __future__ import annotations

from pathlib import Path


def cpu_name_and_flags() -> tuple[str, set[str]]:
    """The CPU's model name and feature flags, from /proc/cpuinfo (empty where there is none)."""
    name, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return name, flags


def isa_summary(flags: set[str]) -> str:
    """The flags that decide matmul speed, e.g. "avx2 fma" or "avx512f avx512_bf16 amx_bf16"."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return " ".join(f for f in wanted if f in flags) or "no AVX2"
