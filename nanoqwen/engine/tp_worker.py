"""Tensor-parallel workers: ranks 1..N-1 run the model on their shards, driven by rank 0 (the engine).

`TPGroup.start` (on rank 0) either starts the N-1 worker processes itself (fresh interpreters running
`worker_main`: nothing of the caller's script runs again in them) or, when `torchrun` started every rank,
joins them; there ranks > 0 turn into workers inside LLMEngine and exit when rank 0 is done. A worker:
  1. joins the process group (nanoqwen/distributed.py),
  2. receives what to load (LoadModel) and loads only its shard of the weights,
  3. receives the KV-cache size rank 0 decided, so every rank has the same blocks (each holding its heads),
  4. runs the forward of every StepInput rank 0 broadcasts, until it receives None (stop).

Failures never hang rank 0: a worker that raises (out of memory, a bug) reports its error over a pipe and
exits; a killed worker just exits. Rank 0's next collective then fails at once (the connection closes) or,
at worst, times out; the engine stops the whole group and raises an EngineDeadError naming the worker.
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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from nanoqwen import distributed
from nanoqwen.errors import ConfigError, EngineDeadError

logger = logging.getLogger("nanoqwen")
WORKER_COMMAND = "import sys; from nanoqwen.engine.tp_worker import worker_main; worker_main(sys.argv[1:])"
JOIN_TIMEOUT = 300.0  # seconds for a started worker to import torch and reach the rendezvous


@dataclass
class LoadModel:
    """Rank 0's first message: which checkpoint to load, and how."""

    model_dir: str
    dtype: torch.dtype
    max_model_len: int
    enforce_eager: bool = False
    quantization: str | None = None


class TPGroup:
    """Rank 0's handle on the tensor-parallel group: the workers it started (none under torchrun), its health."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self.procs: list[subprocess.Popen] = []  # worker rank i + 1
        self.conns: list[Connection] = []  # each worker's reports
        self.errors: dict[int, str] = {}
        self.inbox: dict[int, list[object]] = {}  # each worker's other reports ("joining"), kept until read
        self.dead: str | None = None  # why the group stopped working
        self.closed = False
        self.owns_group = False  # this process's torch.distributed group is this TPGroup's (shut down with it)

    @classmethod
    def start(cls, size: int, device: torch.device, model_dir: Path) -> TPGroup:
        """Start (or, under torchrun, join) the group; on a torchrun rank > 0 this serves rank 0 and exits.

        model_dir: this process's copy of the model (on another node a hub id may resolve to another path).
        """
        distributed.check_no_group()  # before starting anything: another engine's group must be left alone
        env = distributed.torchrun_env()
        if env is not None:
            rank, world, local_rank = env
            if world != size:
                raise ConfigError(f"torchrun started {world} processes but tensor_parallel_size is {size}: "
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
                read_fd, write_fd = os.pipe()  # the worker's reports ("joining", its error) come back on it
                group.conns.append(Connection(read_fd, writable=False))
                cmd = [sys.executable, "-c", WORKER_COMMAND, "--rank", str(rank), "--size", str(size),
                       "--device", device.type, "--init-method", init_method, "--report-fd", str(write_fd),
                       "--threads", str(torch.get_num_threads())]
                # Its own session: Ctrl-C in the terminal reaches rank 0 only, which then stops the workers.
                try:
                    group.procs.append(subprocess.Popen(cmd, pass_fds=(write_fd,), start_new_session=True))
                finally:
                    os.close(write_fd)
                logger.info("tensor-parallel worker %d started (pid %d)", rank, group.procs[-1].pid)
            group._wait_for_workers("joining", JOIN_TIMEOUT)
            group.owns_group = True
            distributed.init_tensor_parallel(0, size, group.device, init_method)
        except BaseException:
            group.shutdown()
            raise
        return group

    # ---- messages to the workers
    def send(self, message: object) -> None:
        """Broadcast a message (LoadModel, the KV-cache size) from rank 0 to the workers."""
        distributed.broadcast_object(message)

    def wait_ready(self, weight_bytes: int) -> list[int]:
        """Wait until every worker has loaded its shard and built its KV cache; every rank's weight bytes."""
        return distributed.gather_objects(weight_bytes)

    # ---- health
    def failure(self, wait: float = 0.0) -> str | None:
        """Why the group broke, if a worker died or reported an error (waiting up to `wait` seconds for one)."""
        deadline = time.monotonic() + wait
        while True:
            for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), 1):
                self._receive(rank, conn)
                if proc.poll() is not None:
                    return self._describe(rank)
            if time.monotonic() >= deadline:
                return next((self._describe(rank) for rank in sorted(self.errors)), None)
            time.sleep(0.02)

    def _describe(self, rank: int) -> str:
        proc, code = self.procs[rank - 1], self.procs[rank - 1].returncode
        how = ("failed" if code is None else f"was killed by {_signal_name(-code)}" if code < 0
               else f"exited with code {code}")
        error = f": {self.errors[rank]}" if rank in self.errors else ""
        return f"tensor-parallel worker {rank} (pid {proc.pid}) {how}{error}"

    def check(self) -> None:
        """Raise EngineDeadError if the group is stopped, or stop it now if a worker died since the last step."""
        if self.dead is None and (reason := self.failure()) is not None:
            self._stop(reason)
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run a step on the group; if any rank fails, stop them all and raise EngineDeadError."""
        self.check()
        with _ctrl_c_after_the_step():
            try:
                yield
            except Exception as e:
                reason = self.failure(wait=3.0) if self.procs else None
                self._stop(reason or f"a tensor-parallel step failed ({type(e).__name__}: {e})")
                raise EngineDeadError(self.dead) from e
            except BaseException:  # a second Ctrl-C in the middle of a step: the ranks are out of step for good
                self._stop("interrupted in the middle of a step")
                raise

    def startup_failure(self, error: BaseException) -> EngineDeadError | None:
        """While starting: stop the group; an EngineDeadError to raise instead of `error` if a worker broke."""
        reason = self.failure(wait=3.0) if self.procs and not isinstance(error, ConfigError) else None
        if reason is not None:
            self._stop(reason)
            return EngineDeadError(self.dead)
        self.shutdown()
        return None

    def _stop(self, reason: str) -> None:
        self.dead = f"{reason}; the tensor-parallel group is stopped"
        logger.error("%s", self.dead)
        self.shutdown()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the workers to stop (kill what does not within `timeout`) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        if self.dead is None and self.owns_group and distributed.tp_size() > 1:
            with contextlib.suppress(Exception):
                distributed.broadcast_object(None)
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        if self.owns_group:
            distributed.destroy_tensor_parallel()
        self.dead = self.dead or "the engine was shut down"

    def _wait_for_workers(self, message: str, timeout: float) -> None:
        """Wait until every worker sent `message`; raise at once if one dies or reports an error."""
        deadline = time.monotonic() + timeout
        pending = set(range(1, self.size))
        while pending:
            for rank in sorted(pending):
                self._receive(rank, self.conns[rank - 1])
                if message in self.inbox.get(rank, []):
                    pending.discard(rank)
            if (reason := self.failure()) is not None:
                raise EngineDeadError(f"{reason} while starting")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"tensor-parallel workers {sorted(pending)} did not start within "
                                      f"{timeout:.0f} s")
            time.sleep(0.02)

    def _receive(self, rank: int, conn: Connection) -> None:
        """Take what a worker sent: its error report into `errors`, anything else into its `inbox`. Every read
        keeps what it took: `failure()` reads the same pipes while `_wait_for_workers` waits for "joining"."""
        with contextlib.suppress(OSError, EOFError):
            while conn.poll():
                message = conn.recv()
                if isinstance(message, tuple) and message[0] == "error":
                    self.errors[rank] = message[1]
                else:
                    self.inbox.setdefault(rank, []).append(message)


@contextlib.contextmanager
def _ctrl_c_after_the_step() -> Iterator[None]:
    """Hold a Ctrl-C until the step is over (a step cut short leaves the ranks out of step), then raise it; a
    second Ctrl-C interrupts at once. Only on the main thread, and only over Python's default handler."""
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
        conn.send("joining")
        distributed.init_tensor_parallel(args.rank, args.size, device, args.init_method)
        run_worker(args.rank, args.size, device)
    except BaseException as e:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(e).__name__}: {e}"))
        print(f"nanoqwen tensor-parallel worker {args.rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        # Leave now: a process group left mid-collective can abort in its C++ destructors at a normal exit.
        os._exit(1)
    conn.close()
    distributed.destroy_tensor_parallel()


def run_worker(rank: int, size: int, device: torch.device, model_dir: Path | None = None) -> None:
    """Load this rank's shard (from model_dir, else rank 0's path), then run every step rank 0 sends until it
    says stop (None)."""
    from nanoqwen.compilation import select_kernels
    from nanoqwen.engine.model_runner import ModelRunner
    from nanoqwen.loader import load_config, load_model
    from nanoqwen.quantization import weight_bytes

    load = distributed.broadcast_object()
    if load is None:
        return
    model_dir = model_dir or Path(load.model_dir)
    model = load_model(model_dir, load_config(model_dir), load.dtype, device, load.max_model_len, rank, size,
                       show_progress=False, quantization=load.quantization)  # int8 scales per row of its shard
    select_kernels(device, load.dtype, load.enforce_eager)
    kv = distributed.broadcast_object()
    if kv is None:
        return
    num_blocks, block_size = kv
    runner = ModelRunner(model, num_blocks, block_size)
    distributed.gather_objects(weight_bytes(model))  # ready, and what this rank holds
    while (step := distributed.broadcast_object()) is not None:
        runner.run_model(step)

