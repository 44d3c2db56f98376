"""The gateway's FastAPI app served by uvicorn on this test's event loop, on a free local port,
for tests that drive ``create_app`` over a stand-in orchestrator with a real HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import socket


@contextlib.asynccontextmanager
async def served(app):
    """Serve ``app`` on 127.0.0.1 (a free port) until the block ends; yields its port. Raises what
    the server raised should it end before it started."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), task.result()
            await asyncio.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()
