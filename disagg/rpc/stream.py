"""Packed lookups to one shard replica on one long-lived ``LookupStream`` call.

A ``Lookup`` call costs grpcio a call set up and torn down on both sides, about as much CPU as gathering a batch's
rows; a message on an open stream costs a fraction of that (``benchmarks/bench_shard_server.py``). Requests carry
a ``sequence`` and replies bring it back, so lookups of concurrent batches share the stream. Each lookup fails as a
``Lookup`` call would, with an ``grpc.aio.AioRpcError`` of the same status: DEADLINE_EXCEEDED past its timeout
(a late reply is dropped), the refusal's status for a refused request, and the stream's own status for every
lookup in flight when the stream ends (the replica died, refused the token, was retired); the next lookup opens a
new stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from disagg.rpc import packed

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a ``Lookup`` call ending with ``code`` raises."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class LookupStream:
    """Lookups to one replica on one ``LookupStream`` call, opened by ``open_call()`` at the first lookup and again
    after the call ends. Used from one event loop."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall]) -> None:
        self._open_call = open_call
        self._call: grpc.aio.StreamStreamCall | None = None
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._writing = asyncio.Lock()  # one message written at a time, as grpcio requires
        self._reader: asyncio.Task[None] | None = None

    async def lookup(self, request: bytes, sequence: int, timeout: float) -> bytes:
        """The reply to ``request`` (a packed ``LookupRequest`` numbered ``sequence``, unique among this stream's
        lookups in flight), within ``timeout`` seconds."""
        if sequence in self._pending:
            raise ValueError(f"sequence {sequence} is already in flight on this stream")
        call = self._open()
        answered: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[sequence] = answered
        try:
            async with asyncio.timeout(timeout):
                async with self._writing:
                    await call.write(request)
                return await answered
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout:.3f}s") from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as error:  # written to a call that had ended
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the lookup stream ended: {error}") from None
        finally:
            self._pending.pop(sequence, None)

    def close(self) -> None:
        """Ends the call; lookups in flight fail with CANCELLED."""
        if self._call is not None:
            self._call.cancel()

    def _open(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            self._call = self._open_call()
            self._reader = asyncio.create_task(self._read(self._call))
        return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        """Hands each reply to its lookup until the call ends, then fails the lookups left."""
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the replica ended the lookup stream")
        try:
            while (raw := await call.read()) is not grpc.aio.EOF:
                header = packed.stream_header(raw)
                answered = self._pending.get(header.sequence)
                if answered is None or answered.done():  # its lookup timed out
                    continue
                if header.status:
                    answered.set_exception(rpc_error(_CODES.get(header.status, grpc.StatusCode.UNKNOWN), header.error))
                else:
                    answered.set_result(raw)
        except grpc.aio.AioRpcError as ended:
            error = ended
        except ValueError as malformed:  # no sequence to route it by: nothing on this stream can be trusted
            error = rpc_error(grpc.StatusCode.INTERNAL, f"malformed reply on the lookup stream: {malformed}")
            call.cancel()
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the lookup stream was closed")
            raise
        finally:
            if self._call is call:
                self._call = None
            for answered in self._pending.values():
                if not answered.done():
                    answered.set_exception(error)
