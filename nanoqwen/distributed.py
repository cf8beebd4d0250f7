"""Tensor parallelism plumbing: the process group and the few collectives the model calls.

With tensor_parallel_size N, N processes (ranks) each hold 1/N of every big weight matrix
(models/qwen3.py shows which part and where the ranks' results are combined). They meet in one
torch.distributed process group: NCCL on GPU, gloo on CPU. Rank 0 runs the engine (scheduler,
sampler); ranks 1..N-1 are workers that run the same forward on their shard (worker/tp_worker.py).
The ranks are either started by nanoqwen itself or by `torchrun` (the RANK / WORLD_SIZE / LOCAL_RANK
environment variables say so).

Two groups over the same ranks:
- the default group carries the model's collectives (all_reduce, gather). Within a step every
  rank answers in milliseconds, so it has a finite timeout: a rank that stops answering fails
  the step, never hangs it;
- a gloo "control" group carries rank 0's messages to the workers (load this, run this step, stop).
  Workers wait on it for as long as the engine is idle, so its timeout is practically unlimited.

Every helper is a no-op when there is no group (tensor_parallel_size 1).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nanoqwen.errors import ConfigError

STEP_TIMEOUT = timedelta(minutes=5)  # one collective of a step; generous for a slow CPU rank
IDLE_TIMEOUT = timedelta(days=3650)  # workers waiting for rank 0's next message

_rank, _size = 0, 1
_control: dist.ProcessGroup | None = None


def tp_size() -> int:
    return _size


def check_no_group() -> None:
    """Refuse a second tensor-parallel group in one process (torch.distributed holds one
    default group)."""
    if dist.is_initialized():
        raise ConfigError("a tensor-parallel group is already running in this process: "
                          "shut the other engine down first (llm.llm_engine.shutdown())")


def init_tensor_parallel(rank: int, size: int, device: torch.device,
                         init_method: str = "env://") -> None:
    """Join the group of `size` ranks as `rank` (env:// reads MASTER_ADDR/MASTER_PORT, as
    torchrun sets them)."""
    global _rank, _size, _control
    check_no_group()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=STEP_TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    _control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _rank, _size = rank, size


def destroy_tensor_parallel() -> None:
    global _rank, _size, _control
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size, _control = 0, 1, None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place; every rank gets the sum."""
    if _size > 1:
        dist.all_reduce(x)
    return x


def gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate the ranks' x along dim, in rank order, on rank 0; the other ranks get None."""
    if _size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_size)] if _rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=dim) if parts is not None else None


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0 sends a picklable object over the control group; every rank returns it."""
    if _size == 1:
        return obj
    box = [obj if _rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable object, in rank order, on every rank (over the control group: it also
    waits until every rank got here, with no timeout to speak of, since loading can take long)."""
    if _size == 1:
        return [obj]
    out: list[Any] = [None] * _size
    dist.all_gather_object(out, obj, group=_control)
    return out


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", 0)))


def free_port() -> int:
    """A free TCP port on the loopback interface (the rendezvous of locally started workers;
    tests, benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
