"""The end of every composition root: start what serves, announce where, serve until SIGTERM/SIGINT, then
stop gracefully and close the rest."""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence

if TYPE_CHECKING:
    from shared.serving.server.grpc_server import GrpcServer

logger = logging.getLogger(__name__)


def announce(line: str) -> None:
    """Prints what the process serves where. Flushed: the launcher's logs, tests and operators read stdout
    as it comes (tests read the address from "<name> listening on HOST:PORT ...", printed once it serves)."""
    print(line, flush=True)


async def serve_until_stopped(
    server: GrpcServer, start: Callable[[], Awaitable[Sequence[str]]], closers: contextlib.AsyncExitStack
) -> None:
    """Runs `start` (bind the server, start what serves beside it, flip readiness) and announces the lines
    it returns; serves until SIGTERM/SIGINT or request_stop(); then stops gracefully (readiness
    NOT_SERVING, the on_shutdown callbacks, in-flight RPCs within the grace period) and closes what
    `closers` holds, the last registered first. The stop and the closing also run when `start` fails."""
    try:
        try:
            lines = await start()
        except ValueError as exc:  # a setting or the checkpoint was refused: the message names it
            logger.debug("start-up refused", exc_info=True)
            logger.error("cannot start: %s", exc)
            raise SystemExit(1) from None
        for line in lines:
            announce(line)
        await server.serve_forever()
    finally:
        await server.stop()
        await closers.aclose()
