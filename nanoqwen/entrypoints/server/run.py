"""`nanoqwen serve`: load the engine, build the app, run it under uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

from nanoqwen.engine.llm_engine import LLMEngine
from nanoqwen.entrypoints.engine_args import engine_config_from_args, memory_size
from nanoqwen.entrypoints.server.api import build_app
from nanoqwen.errors import ConfigError, EngineDeadError
from nanoqwen.lora.request import LoRARequest


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("NANOQWEN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 "
                        "(default: $NANOQWEN_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: --model)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for their first token before new ones get 503 "
                        "(default 256)")
    p.add_argument("--max-body-bytes", type=memory_size, default=8 << 20,
                   help="largest request body (default 8MiB)")
    p.add_argument("--shutdown-timeout", type=int, default=10,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM "
                        "before they are cancelled")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-ui", action="store_true",
                   help="do not serve the chat page at / (the API is unchanged)")
    p.add_argument("--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to serve, each by NAME as a request's model "
                        "(needs --enable-lora; docs/lora.md)")


def lora_module(text: str) -> tuple[str, str]:
    """--lora-modules: NAME=PATH."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH (an adapter's name and its PEFT folder)")
    return name, path


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    class _Server(uvicorn.Server):
        grace: float
        cancel_all: Callable[[], None]

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # Stopped listening; in-flight requests get `grace` seconds to
            # finish, then are cancelled.
            timer = asyncio.get_running_loop().call_later(self.grace, self.cancel_all)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()


    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("max_waiting", "max_body_bytes", "shutdown_timeout"):  # the server's own options
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.lora_modules and not args.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    engine = LLMEngine(engine_config_from_args(args))
    try:
        for i, (name, path) in enumerate(args.lora_modules, start=1):
            engine.add_lora(LoRARequest(name, i, path))
        _run(args, engine, _Server)
    finally:
        engine.shutdown()  # stops tensor-parallel workers, if any


def _run(args: argparse.Namespace, engine: Any, server_class: type) -> None:
    """Serve `engine` until SIGINT/SIGTERM, or until the engine dies (then raise its
    EngineDeadError)."""
    import uvicorn


    log = logging.getLogger("nanoqwen.server")
    stats = engine.kv_cache_stats
    log.info("loaded %s (%s, %s, task %s): max_model_len %d, %d KV blocks of %d tokens",
             args.model, engine.device, engine.dtype, engine.task, engine.max_model_len,
             stats["num_blocks"], stats["block_size"])
    app = build_app(engine, args.served_model_name or str(args.model), api_key=args.api_key,
                    max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
                    ui=not args.no_ui)
    # uvicorn's own timeout is only a backstop: at --shutdown-timeout we end the requests ourselves,
    # so their streams close with an error event instead of being cut (and logged as tracebacks).
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=args.shutdown_timeout + 5,
                            lifespan="on")
    server = server_class(config)
    if not args.no_ui:
        host = "localhost" if args.host in ("0.0.0.0", "::", "") else args.host
        host = f"[{host}]" if ":" in host else host
        log.info("chat page: http://%s:%d/ (--no-ui turns it off)", host, args.port)
    async_engine = app.state.server.async_engine
    server.grace, server.cancel_all = args.shutdown_timeout, async_engine.cancel_all
    # A dead engine (a tensor-parallel worker died) cannot recover: stop serving
    # and exit with its error.
    async_engine.on_dead = lambda _: setattr(server, "should_exit", True)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these no-op handlers
    # in place that ends serve() normally, so a requested shutdown exits with status 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if async_engine.dead is not None:
        raise EngineDeadError(async_engine.dead)
    log.info("server stopped")
