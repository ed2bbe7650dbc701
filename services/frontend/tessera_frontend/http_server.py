"""The HTTP server for the OpenAI-compatible API: uvicorn, in the frontend's own event loop.

uvicorn.Server(...).serve() runs as a task beside the grpc.aio server, so both
APIs share one AsyncLLM without threads. The frontend owns signal handling and
shutdown: uvicorn's own signal capture is turned off and `stop()` asks it to
finish (open streams get `grace_s` to end).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers (the frontend's shutdown stops it)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


class HttpServer:
    def __init__(self, app, host: str, port: int, grace_s: float = 5.0, certfile: str | None = None,
                 keyfile: str | None = None) -> None:
        # certfile / keyfile: HTTPS (the frontend's --tls-cert-file / --tls-key-file)
        config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                                lifespan="off", timeout_graceful_shutdown=grace_s,
                                ssl_certfile=certfile, ssl_keyfile=keyfile)
        self.host, self.port = host, port
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Start serving; raises if the port cannot be bound."""
        self._task = asyncio.create_task(self._server.serve(), name="http-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raise the failure
                raise RuntimeError(f"the HTTP server on {self.host}:{self.port} stopped at startup")
            await asyncio.sleep(0.02)
        log.info("HTTP (OpenAI-compatible) API listening", extra={"http_port": self.port})

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
