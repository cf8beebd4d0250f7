"""AsyncEngine: the synchronous LLMEngine driven from one background thread, for asyncio handlers.

LLMEngine is not thread-safe, so exactly one thread (the engine loop) ever touches it. Handlers
talk to it through a thread-safe queue of commands (AddRequest / AbortRequest / CancelAll / Stop);
the loop drains the queue, runs step() while there is work, blocks on the queue when idle (no
busy-wait), and hands each step's outputs back to the event loop with one call_soon_threadsafe.
Each request's RequestStream keeps only its latest output: outputs are cumulative, so a slow client
skips intermediate states instead of queueing them. A pooling request (embed, score: PoolingParams)
has one output, its result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, assert_never

from nanoqwen.entrypoints.server.protocol import APIError
from nanoqwen.errors import EngineDeadError, InvalidRequestError
from nanoqwen.outputs import PoolingRequestOutput, RequestOutput
from nanoqwen.pooling_params import PoolingParams
from nanoqwen.sampling_params import SamplingParams

logger = logging.getLogger("nanoqwen.server")
# an idle loop still looks this often whether the engine died (a worker crashed)
HEALTH_CHECK_SECONDS = 1.0
# what a step gives a request: text so far (generate) or its embedding / score (embed, score)
Output = RequestOutput | PoolingRequestOutput


class RequestStream:
    """One request's outputs as seen by its handler (lives on the event loop's thread)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.latest: Output | None = None
        self.error: APIError | None = None
        self.finished = False
        self.first_output_time: float | None = None
        self._event = asyncio.Event()

    def _put(self, item: Output | APIError | None) -> None:
        if isinstance(item, APIError):
            self.finished = True
            if not self.accepted.done():
                self.accepted.set_exception(item)
                # marks it retrieved: no "never retrieved" warning if nobody waits
                self.accepted.exception()
            self.error = item
        elif item is None:  # the engine took the request
            if not self.accepted.done():
                self.accepted.set_result(None)
            return
        else:
            self.latest = item
            self.finished = item.finished
            if self.first_output_time is None:
                self.first_output_time = time.perf_counter()
        self._event.set()

    async def __aiter__(self) -> AsyncIterator[Output]:
        """The request's outputs until it finishes (an engine failure raises its APIError)."""
        while True:
            await self._event.wait()
            self._event.clear()
            if self.error is not None:
                raise self.error
            if self.latest is not None:
                yield self.latest
                if self.latest.finished:
                    return


# ---- commands from the event loop to the engine-loop thread (through AsyncEngine._commands)
@dataclass(frozen=True)
class AddRequest:
    """Put a request into the engine; its stream then hears whether the engine took it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    stream: RequestStream
    lora_request: Any = None  # the LoRA adapter it runs with (a LoRARequest), if any


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request and free its KV blocks."""

    request_id: str


@dataclass(frozen=True)
class CancelAll:
    """End every request now with a 503 'shutting down'."""


@dataclass(frozen=True)
class Stop:
    """Cancel what is left and end the loop thread."""


@dataclass(frozen=True)
class CallEngine:
    """Run fn(engine) on the engine loop (loading or removing a LoRA adapter); its result or error goes to
    `future`."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


Command = AddRequest | AbortRequest | CancelAll | Stop | CallEngine
# what the event loop gets, in order: an output, an error, or None (the engine took the request)
Delivery = tuple[RequestStream, Output | APIError | None]


class AsyncEngine:
    def __init__(self, engine: Any, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        # replaced (never mutated) by the loop
        self.stats: dict[str, float] = dict(engine.kv_cache_stats)
        self.streams: dict[str, RequestStream] = {}  # event-loop side: requests not yet finished
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # why the engine stopped for good (a tensor-parallel worker died)
        self.dead: str | None = None
        # called from the loop thread
        self.on_dead: Callable[[EngineDeadError], None] | None = None

    # ---- event-loop side ----
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="nanoqwen-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is left and end the loop thread (after its current step)."""
        if self._thread is not None:
            self._commands.put(Stop())
            await asyncio.to_thread(self._thread.join, timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests accepted by the server that have no output yet (queued or prefilling)."""
        return sum(1 for s in self.streams.values() if s.first_output_time is None)

    @property
    def num_running(self) -> int:
        return len(self.streams) - self.num_waiting

    def admit(self, check_queue: bool = True) -> None:
        """Raise a 503 unless a new request may queue: the engine runs and (check_queue) fewer
        than max_waiting requests wait."""
        if not self.alive:
            reason = f": {self.dead}" if self.dead else ""
            raise APIError(503, f"the engine is not running{reason}", type="server_error",
                           code="engine_dead")
        if check_queue and self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise APIError(503, f"the server is overloaded: {self.num_waiting} requests are "
                                f"waiting (--max-waiting {self.max_waiting}); retry later",
                           type="server_error", code="queue_full", headers={"Retry-After": "1"})

    async def add(self, request_id: str, prompt_token_ids: list[int],
                  params: SamplingParams | PoolingParams, admitted: bool = False,
                  lora_request: Any = None) -> RequestStream:
        """Queue a request; return once the engine took it (an InvalidRequestError: a 400 here).

        admitted: admit() already passed for the HTTP request this is part of (the inputs of one
        embedding request queue together, however many there are).
        """
        self.admit(check_queue=not admitted)
        stream = RequestStream(request_id)
        self.streams[request_id] = stream
        self._commands.put(AddRequest(request_id, prompt_token_ids, params, stream, lora_request))
        try:
            await stream.accepted
        except BaseException:  # rejected, or the handler was cancelled while waiting
            self.abort(request_id)
            raise
        return stream

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine), run on the engine loop between steps (the one thread that touches the engine)."""
        self.admit(check_queue=False)  # (a 503 once the engine is dead or stopping)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(CallEngine(fn, future))
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (a no-op once it finished)."""
        stream = self.streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._commands.put(AbortRequest(request_id))

    def cancel_all(self) -> None:
        """End every request now with a 503 'shutting down' (each stream's last event)."""
        self._commands.put(CancelAll())

    def _deliver(self, items: list[Delivery]) -> None:
        for stream, item in items:
            stream._put(item)
            if stream.finished:
                self.streams.pop(stream.request_id, None)

    # ---- engine-loop thread ----
    def _run(self) -> None:
        # the loop thread's own view: requests inside the engine
        streams: dict[str, RequestStream] = {}
        while True:
            out: list[Delivery] = []
            try:
                running = self._iteration(streams, out)
            except Exception as e:
                # a bug outside step(): fail what is in flight rather than die silently
                logger.exception("engine loop error; failing %d request(s)", len(streams))
                self._fail_all(streams, out, _engine_error(e))
                running = True
            self._send(out)
            if not running:
                return

    def _iteration(self, streams: dict[str, RequestStream], out: list[Delivery]) -> bool:
        """Take the commands and handle each, check the engine's health when idle, run one step if
        there is work and pair its outputs with their streams; False once the loop should end."""
        commands = self._take_commands()
        for command in commands:
            if not self._handle(command, streams, out):
                return False
        engine = self.engine
        try:
            if not commands and not engine.has_unfinished_requests():  # idle a while: still alive?
                getattr(engine, "check_health", lambda: None)()
            outputs = self._step(streams, out) if engine.has_unfinished_requests() else []
        except EngineDeadError as e:  # it cannot step again
            return self._engine_died(streams, out, e)
        for o in outputs:
            stream = streams.get(o.request_id)
            if stream is not None:
                # a request that ended with an error of its own fails alone
                out.append((stream, o if o.error is None else _request_error(o.error)))
                if o.finished:
                    del streams[o.request_id]
        self.stats = dict(engine.kv_cache_stats)
        return True

    def _take_commands(self) -> list[Command]:
        """The commands queued now. Idle: block until one comes (waking now and then for a health
        check). Busy: take what is there and keep stepping."""
        commands = []
        if not self.engine.has_unfinished_requests():
            with contextlib.suppress(queue.Empty):
                commands.append(self._commands.get(timeout=HEALTH_CHECK_SECONDS))
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, command: Command, streams: dict[str, RequestStream],
                out: list[Delivery]) -> bool:
        """Carry out one command; False if it is Stop (the loop ends)."""
        match command:
            case AddRequest(request_id, token_ids, params, stream):
                try:
                    lora = {"lora_request": command.lora_request} if command.lora_request is not None else {}
                    self.engine.add_request(request_id, token_ids, params,
                                            prompt_token_ids=token_ids, **lora)
                    streams[request_id] = stream
                    out.append((stream, None))
                except InvalidRequestError as e:
                    out.append((stream, APIError(400, str(e), param=e.param)))
                except Exception as e:  # an engine bug, not the user's fault: serve the others
                    logger.exception("add_request failed for %s", request_id)
                    out.append((stream, APIError(500, f"the engine failed to add the request: {e}",
                                                 type="server_error", code="engine_error")))
            case AbortRequest(request_id):
                streams.pop(request_id, None)
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    logger.exception("abort_request failed for %s", request_id)
            case CallEngine(fn, future):
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:  # (the caller gets it)
                    future.set_exception(e)
            case CancelAll():
                self._fail_all(streams, out, _shutting_down())
            case Stop():
                self._fail_all(streams, out, _shutting_down())
                return False
            case _:
                assert_never(command)
        return True

    def _step(self, streams: dict[str, RequestStream], out: list[Delivery]) -> list[Output]:
        """One engine step's outputs. A step that one request broke ends that request alone (the engine runs
        the step again without it: its output carries the error); a failure that is no one request's (not
        EngineDeadError) fails every request in flight, and the server keeps serving."""
        try:
            return self.engine.step()
        except EngineDeadError:
            raise
        except Exception as e:
            logger.exception("engine step failed; failing %d request(s)", len(streams))
            self._fail_all(streams, out, _engine_error(e))
            return []

    def _engine_died(self, streams: dict[str, RequestStream], out: list[Delivery],
                     e: EngineDeadError) -> bool:
        """Fail every request with the reason, tell the server (on_dead), end the loop (False)."""
        logger.error("the engine stopped: %s", e)
        self.dead = str(e)
        self._fail_all(streams, out, APIError(500, f"the engine stopped: {e}", type="server_error",
                                              code="engine_dead"))
        if self.on_dead is not None:
            self.on_dead(e)
        return False

    def _fail_all(self, streams: dict[str, RequestStream], out: list[Delivery],
                  error: APIError) -> None:
        for request_id, stream in list(streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort_request failed for %s", request_id)
            out.append((stream, error))
        streams.clear()

    def _send(self, out: list[Delivery]) -> None:
        if out and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._deliver, out)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutdown")


def _request_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="request_failed")


def _engine_error(e: Exception) -> APIError:
    return APIError(500, f"the engine failed: {type(e).__name__}: {e}", type="server_error",
                    code="engine_error")
