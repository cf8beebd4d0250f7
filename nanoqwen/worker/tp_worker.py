"""Tensor-parallel workers: ranks 1..N-1 run the model on their shards, driven by rank 0 (the
engine).

`TPGroup.start` (on rank 0) either starts the N-1 worker processes itself (fresh interpreters
running `worker_main`: nothing of the caller's script runs again in them) or, when `torchrun`
started every rank, joins them; there ranks > 0 turn into workers inside LLMEngine and exit when
rank 0 is done. A worker:
  1. joins the process group (nanoqwen/distributed.py),
  2. receives what to load (LoadModel) and loads only its shard of the weights,
  3. receives the KV-cache size rank 0 decided (KVCacheSize), so every rank has the same blocks
     (each holding its heads),
  4. runs the forward of every StepInput rank 0 broadcasts, until it receives None (stop); with LoRA
     adapters a step first brings the adapters and slots that changed (StepInput.lora_sync).

Failures never hang rank 0: a worker that raises (out of memory, a bug) reports its error over a
pipe (WorkerFailed) and exits; a killed worker just exits. Rank 0's next collective then fails at
once (the connection closes) or, at worst, times out; the engine stops the whole group and raises an
EngineDeadError naming the worker (TPGroup.failure says why, TPGroup._die stops the group).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch

import nanoqwen.distributed as distributed
from nanoqwen.errors import ConfigError, EngineDeadError
from nanoqwen.lora.manager import LoRAManager
from nanoqwen.model_loader.loader import load_config
from nanoqwen.quantization import weight_bytes
from nanoqwen.worker.loading import load_model_with_kernels
from nanoqwen.worker.model_runner import ModelRunner

logger = logging.getLogger("nanoqwen")
WORKER_COMMAND = ("import sys; from nanoqwen.worker.tp_worker import worker_main; "
                  "worker_main(sys.argv[1:])")
JOIN_TIMEOUT = 300.0  # seconds for a started worker to import torch and reach the rendezvous


@dataclass
class LoadModel:
    """Rank 0's first message: which checkpoint to load, and how."""

    model_dir: str
    dtype: torch.dtype
    max_model_len: int
    enforce_eager: bool = False
    quantization: str | None = None
    # LoRA adapters (nanoqwen/lora/): the slots and their rank, as rank 0's LoRAManager has them (0: no adapters)
    max_loras: int = 0
    max_lora_rank: int = 0


@dataclass
class KVCacheSize:
    """Rank 0's second message: the KV cache it sized, so every rank has the same blocks."""

    num_blocks: int
    block_size: int
    kv_cache_dtype: str = "auto"


# ---- a worker's reports to rank 0, over its pipe
@dataclass
class Joining:
    """The worker started and is joining the process group."""


@dataclass
class WorkerFailed:
    """The worker raised (it exits next): `message` is the exception, "Type: text"."""

    message: str


@dataclass
class Worker:
    """Rank 0's record of one worker process it started."""

    rank: int
    proc: subprocess.Popen
    conn: Connection  # the worker's reports
    error: str | None = None  # its WorkerFailed message, once read
    # its other reports (Joining), kept until read
    inbox: list[object] = field(default_factory=list)

    def receive(self) -> None:
        """Take what the worker sent: a WorkerFailed into `error`, anything else into `inbox`. Every
        read keeps what it took: `failure()` reads the same pipes while `_wait_for_workers` waits
        for Joining."""
        with contextlib.suppress(OSError, EOFError):
            while self.conn.poll():
                match self.conn.recv():
                    case WorkerFailed(message):
                        self.error = message
                    case report:
                        self.inbox.append(report)


class TPGroup:
    """Rank 0's handle on the tensor-parallel group: the workers it started (none under torchrun),
    its health."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self.workers: list[Worker] = []  # the worker processes it started, rank 1 first
        self.dead: str | None = None  # why the group stopped working
        self.closed = False
        # this process's torch.distributed group is this TPGroup's (shut down with it)
        self.owns_group = False

    @classmethod
    def start(cls, size: int, device: torch.device, model_dir: Path) -> TPGroup:
        """Start (or, under torchrun, join) the group; on a torchrun rank > 0 this serves rank 0 and
        exits.

        model_dir: this process's copy of the model (on another node a hub id may resolve to another
        path).
        """
        # before starting anything: another engine's group must be left alone
        distributed.check_no_group()
        env = distributed.torchrun_env()
        if env is not None:
            rank, world, local_rank = env
            if world != size:
                raise ConfigError(f"torchrun started {world} processes but "
                                  f"tensor_parallel_size is {size}: "
                                  f"give torchrun as many processes as --tensor-parallel-size")
            device = _rank_device(device, local_rank)
            distributed.init_tensor_parallel(rank, size, device)
            if rank != 0:
                try:
                    run_worker(rank, size, device, model_dir)
                finally:
                    distributed.destroy_tensor_parallel()
                raise SystemExit(0)
            group = cls(size, device)
            group.owns_group = True
            return group

        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ConfigError(f"tensor_parallel_size={size} needs {size} GPUs, torch sees "
                              f"{torch.cuda.device_count()}")
        group = cls(size, _rank_device(device, 0))
        init_method = f"tcp://127.0.0.1:{distributed.free_port()}"
        try:  # (a failure part-way stops the workers already started)
            for rank in range(1, size):
                # the worker's reports (Joining, WorkerFailed) come back on it
                read_fd, write_fd = os.pipe()
                conn = Connection(read_fd, writable=False)
                cmd = [sys.executable, "-c", WORKER_COMMAND, "--rank", str(rank),
                       "--size", str(size), "--device", device.type, "--init-method", init_method,
                       "--report-fd", str(write_fd), "--threads", str(torch.get_num_threads())]
                # Its own session: Ctrl-C in the terminal reaches rank 0 only, which then stops the
                # workers.
                try:
                    proc = subprocess.Popen(cmd, pass_fds=(write_fd,), start_new_session=True)
                except BaseException:
                    conn.close()
                    raise
                finally:
                    os.close(write_fd)
                group.workers.append(Worker(rank, proc, conn))
                logger.info("tensor-parallel worker %d started (pid %d)", rank, proc.pid)
            group._wait_for_workers(Joining(), JOIN_TIMEOUT)
            group.owns_group = True
            distributed.init_tensor_parallel(0, size, group.device, init_method)
        except BaseException:
            group.shutdown()
            raise
        return group

    # ---- messages to the workers
    def send(self, message: object) -> None:
        """Broadcast a message (LoadModel, KVCacheSize) from rank 0 to the workers."""
        distributed.broadcast_object(message)

    def wait_ready(self, weight_bytes: int) -> list[int]:
        """Wait until every worker has loaded its shard and built its KV cache; every rank's weight
        bytes."""
        return distributed.gather_objects(weight_bytes)

    # ---- health
    def failure(self, wait: float = 0.0) -> str | None:
        """Why the group is dead, if a worker died or reported an error (looking up to `wait`
        seconds for one to end): its rank, pid, how it ended and its error report; None while all
        are well."""
        worker = self._failed_worker(wait)
        if worker is None:
            return None
        code = worker.proc.returncode
        how = ("failed" if code is None else f"was killed by {_signal_name(-code)}" if code < 0
               else f"exited with code {code}")
        error = f": {worker.error}" if worker.error is not None else ""
        return f"tensor-parallel worker {worker.rank} (pid {worker.proc.pid}) {how}{error}"

    def _failed_worker(self, wait: float) -> Worker | None:
        """The first worker that ended, else (once `wait` is over) the first that reported an
        error."""
        deadline = time.monotonic() + wait
        while True:
            for worker in self.workers:
                worker.receive()
                if worker.proc.poll() is not None:
                    return worker
            if time.monotonic() >= deadline:
                return next((w for w in self.workers if w.error is not None), None)
            time.sleep(0.02)

    def _die(self, reason: str, starting: bool = False) -> EngineDeadError:
        """The one way a failure ends the group: record why (`dead`), stop every worker, and return
        the EngineDeadError for the caller to raise. Once started, the reason is logged and says
        that the group is stopped; while `starting`, the error raised out of `start` is the only
        report."""
        if starting:
            self.dead = reason
        else:
            self.dead = f"{reason}; the tensor-parallel group is stopped"
            logger.error("%s", self.dead)
        self.shutdown()
        return EngineDeadError(self.dead)

    def check(self) -> None:
        """Raise EngineDeadError if the group is stopped, or stop it now if a worker died since the
        last step."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if (reason := self.failure()) is not None:
            raise self._die(reason)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run a step on the group; if any rank fails, stop them all and raise EngineDeadError."""
        self.check()
        with _ctrl_c_after_the_step():
            try:
                yield
            except Exception as e:
                reason = self.failure(wait=3.0) if self.workers else None
                reason = reason or f"a tensor-parallel step failed ({type(e).__name__}: {e})"
                raise self._die(reason) from e
            except BaseException:
                # a second Ctrl-C in the middle of a step: the ranks are out of step for good
                self._die("interrupted in the middle of a step")
                raise

    def startup_failure(self, error: BaseException) -> EngineDeadError | None:
        """While starting: stop the group; an EngineDeadError to raise instead of `error` if a
        worker broke."""
        reason = (self.failure(wait=3.0) if self.workers and not isinstance(error, ConfigError)
                  else None)
        if reason is None:
            self.shutdown()
            return None
        return self._die(reason)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the workers to stop (kill what does not within `timeout`) and leave the process
        group."""
        if self.closed:
            return
        self.closed = True
        if self.dead is None and self.owns_group and distributed.tp_size() > 1:
            with contextlib.suppress(Exception):
                distributed.broadcast_object(None)
            for worker in self.workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.proc.wait(timeout)
        for worker in self.workers:
            if worker.proc.poll() is None:
                worker.proc.kill()
                worker.proc.wait()
            worker.conn.close()
        if self.owns_group:
            distributed.destroy_tensor_parallel()
        self.dead = self.dead or "the engine was shut down"

    def _wait_for_workers(self, report: object, timeout: float) -> None:
        """Wait until every worker sent `report`; stop the group and raise at once if one dies or
        reports an error."""
        deadline = time.monotonic() + timeout
        pending = list(self.workers)
        while pending:
            for worker in pending:
                worker.receive()
            pending = [w for w in pending if report not in w.inbox]
            if (reason := self.failure()) is not None:
                raise self._die(f"{reason} while starting", starting=True)
            if pending and time.monotonic() > deadline:
                ranks = [w.rank for w in pending]
                raise self._die(f"tensor-parallel workers {ranks} did not start "
                                f"within {timeout:.0f} s", starting=True)
            time.sleep(0.02)


@contextlib.contextmanager
def _ctrl_c_after_the_step() -> Iterator[None]:
    """Hold a Ctrl-C until the step is over (a step cut short leaves the ranks out of step), then
    raise it; a second Ctrl-C interrupts at once. Only on the main thread, and only over Python's
    default handler."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pending = []

    def hold(signum: int, frame: object) -> None:
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _rank_device(device: torch.device, index: int) -> torch.device:
    """Rank's device: the CPU, or GPU number `index` (the local rank) with CUDA."""
    return torch.device("cuda", index) if device.type == "cuda" else device


def worker_main(argv: list[str] | None = None) -> None:
    """Entry point of a worker process that rank 0 started (WORKER_COMMAND)."""
    p = argparse.ArgumentParser(description="a nanoqwen tensor-parallel worker (started by rank 0)")
    for name in ("--rank", "--size", "--report-fd", "--threads"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--init-method", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = _rank_device(torch.device(args.device), args.rank)
    conn = Connection(args.report_fd, readable=False)
    try:
        conn.send(Joining())
        distributed.init_tensor_parallel(args.rank, args.size, device, args.init_method)
        run_worker(args.rank, args.size, device)
    except BaseException as e:
        with contextlib.suppress(Exception):
            conn.send(WorkerFailed(f"{type(e).__name__}: {e}"))
        print(f"nanoqwen tensor-parallel worker {args.rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        # Leave now: a process group left mid-collective can abort in its C++ destructors at a
        # normal exit.
        os._exit(1)
    conn.close()
    distributed.destroy_tensor_parallel()


def run_worker(rank: int, size: int, device: torch.device, model_dir: Path | None = None) -> None:
    """Load this rank's shard (from model_dir, else rank 0's path), then run every step rank 0 sends
    until it says stop (None)."""
    load = distributed.broadcast_object()
    if load is None:
        return
    model_dir = model_dir or Path(load.model_dir)
    # int8 scales per row of its shard
    model = load_model_with_kernels(model_dir, load_config(model_dir), load.dtype, device, load.max_model_len,
                                    load.enforce_eager, load.quantization, rank, size, show_progress=False)
    kv: KVCacheSize | None = distributed.broadcast_object()
    if kv is None:
        return
    # this rank's shard of every adapter, in the slots rank 0 chooses (StepInput.lora_sync)
    lora = LoRAManager(model, load.max_loras, load.max_lora_rank) if load.max_loras else None
    runner = ModelRunner(model, kv.num_blocks, kv.block_size, kv_cache_dtype=kv.kv_cache_dtype, lora=lora)
    distributed.gather_objects(weight_bytes(model))  # ready, and what this rank holds
    while (step := distributed.broadcast_object()) is not None:
        if step.lora_sync is not None:  # adapters rank 0 added or removed, and its slots
            lora.apply_sync(step.lora_sync)
        runner.run_model(step)

