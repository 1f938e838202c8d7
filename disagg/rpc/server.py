"""gRPC server of one shard of a model's embedding table rows; CLI: ``python -m disagg.rpc.server --help``.

``Lookup`` is handled on raw bytes: a packed request of a table shard is answered by one gather per slice into the
reply buffer, the reply written by hand (``disagg.rpc.packed``), on the event loop when it asks for at most
``inline_max_ids`` ids, in a small thread pool otherwise (and for any other shard module), so health checks keep
answering; which of grpcio's servers costs least is measured by ``benchmarks/bench_shard_server.py``. A bad request
never reaches the tables and gets INVALID_ARGUMENT (RESOURCE_EXHAUSTED above ``max_message_bytes``) naming the
problem. Floating outputs go out in the request's ``output_dtype``; every response and ``Info`` carry the shard's
``version``. A
non-private ``host`` needs TLS or a token (``exposure_problem``); with a token, ``Lookup`` and ``Info`` need
``authorization: Bearer <token>`` metadata (read from ``SWIFTSERVE_EMBEDDING_TOKEN``, never a flag), the health
service stays open.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import ipaddress
import math
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Protocol

import grpc
import torch
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from disagg.rpc import packed, wire
from disagg.rpc._proto import embedding_pb2 as pb
from disagg.rpc.tls import ServerTLS, read_pem
from disagg.rpc.wire import SERVICE_NAME
from serving.common.constants import EMBEDDING_TOKEN
from serving.common.device import set_torch_threads
from serving.common.logging import get_logger
from serving.common.tokens import SecretDigest

MiB = 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB
#: Table-shard lookups of at most this many ids run on the event loop (no thread hop); larger ones in the pool.
INLINE_MAX_IDS = 1 << 16

#: Longest status details sent (gRPC refuses trailers above 16 KiB), longest input name quoted in them, and most
#: unknown input names listed.
_MAX_DETAILS = 2048
_MAX_NAME = 64
_LISTED = 3

logger = get_logger("disagg.rpc.server")


class Shard(Protocol):
    """What the server hosts; ``disagg.tables.TableShard`` is one."""

    @property
    def index(self) -> int: ...
    @property
    def module(self) -> Any: ...  # called as module(**inputs) -> dict[str, Tensor] keyed by output_names
    @property
    def input_names(self) -> tuple[str, ...]: ...
    @property
    def output_names(self) -> tuple[str, ...]: ...
    @property
    def parameter_bytes(self) -> int: ...
    @property
    def version(self) -> str: ...  # what the shard serves (``disagg.tables.shard_version``), in every response


def exposure_problem(host: str, *, secured: bool) -> str | None:
    """Why serving on ``host`` is refused, or None: without TLS or a token (``secured``), only loopback and
    private addresses (RFC 1918, ULA ``fc00::/7``, the other ranges ``ipaddress`` calls private) are allowed;
    host names other than ``localhost`` count as public (what they resolve to can change)."""
    if secured or _is_internal(host):
        return None
    return (
        f"{host!r} is neither a loopback nor a private address; serving there needs TLS or a token "
        "(SWIFTSERVE_EMBEDDING_TOKEN)"
    )


def _is_internal(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or (address.is_private and not address.is_unspecified)


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class _BearerToken:
    """Checks call metadata for ``authorization: Bearer <token>`` (``SecretDigest``: constant time, digest only)."""

    def __init__(self, token: str) -> None:
        if not (token.isascii() and token.isprintable() and " " not in token):
            raise ValueError("the embedding token must be printable ASCII without spaces (gRPC metadata)")
        self._secret = SecretDigest(token.encode())

    def refusal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> tuple[str, str] | None:
        """None when the metadata carries the token, else (reason to log, details for the caller)."""
        value = next((value for key, value in metadata or () if key == "authorization"), None)
        if value is None:
            return "no token", "missing token: send call metadata `authorization: Bearer <token>`"
        raw = value.encode() if isinstance(value, str) else value
        scheme, _, presented = raw.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not presented.strip():
            return "not a Bearer token", "call metadata `authorization` must be `Bearer <token>`"
        if not self._secret.matches(presented.strip()):
            return "wrong token", "invalid token"
        return None


class _Servicer:
    """``Lookup`` and ``LookupStream`` (raw bytes in and out: ``answer``) and ``Info``, behind handlers that
    authenticate.

    A packed lookup of a table shard is one gather per slice into the reply buffer (``TableLookup.gather``), its
    reply written by hand (``disagg.rpc.packed``); lookups of at most ``inline_max_ids`` ids run on the event loop,
    larger ones (and every lookup of a shard module without ``gather``) in ``pool``, so health checks keep answering.
    """

    def __init__(
        self,
        shard: Shard,
        info: pb.ShardInfo,
        pool: ThreadPoolExecutor,
        max_elements: int,
        token: _BearerToken | None = None,
        inline_max_ids: int = 0,
    ) -> None:
        self._shard = shard
        self._info = info
        self._pool = pool
        self._max_elements = max_elements
        self._expected = frozenset(shard.input_names)
        self._token = token
        self._gather = getattr(shard.module, "gather", None)
        self._widths = list(getattr(shard.module, "widths", ()))
        self._inline_max_ids = inline_max_ids if self._gather is not None else 0
        self.lookups_in_flight = 0
        #: serialized lookup requests and replies of the lookups answered (refusals not counted)
        self.bytes_received = self.bytes_sent = 0
        self._busy_seconds = 0.0  # finished busy spells (a Lookup in flight); the current one began at _busy_since
        self._busy_since = 0.0

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        info = self._handler("Info", pb.InfoRequest.FromString, pb.ShardInfo.SerializeToString, self.Info)

        async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            await self._authenticate("LookupStream", context)
            async for reply in self.LookupStream(requests, context):
                yield reply

        return {"Lookup": self._handler("Lookup", None, None, self.Lookup), "Info": info,
                "LookupStream": grpc.stream_stream_rpc_method_handler(stream)}

    def _handler(
        self,
        method: str,
        parse: Callable[[bytes], Message] | None,
        serialize: Callable[[Message], bytes] | None,
        call: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
    ) -> grpc.RpcMethodHandler:
        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            await self._authenticate(method, context)
            if parse is None:
                return await call(raw, context)
            try:
                request = parse(raw)
            except DecodeError as error:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method}Request message: {error}")
            return await call(request, context)

        return grpc.unary_unary_rpc_method_handler(handle, response_serializer=serialize)

    async def _authenticate(self, method: str, context: grpc.aio.ServicerContext) -> None:
        if self._token is None:
            return
        if refusal := self._token.refusal(context.invocation_metadata()):
            reason, details = refusal
            logger.info("refused %s from %s: %s", method, context.peer(), reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.ShardInfo:
        return self._info

    async def Lookup(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """The serialized ``LookupResponse`` to the serialized ``LookupRequest`` ``raw``; counted in
        ``lookups_in_flight`` until answered, refused or cancelled (a refusal leaves the count first)."""
        try:
            with self._in_flight():
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    raise _Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the lookup started")
                return await self._answered(raw, stream=False)
        except _Refusal as caught:
            refusal = caught
        await _abort(context, refusal.code, refusal.details)

    async def LookupStream(self, requests: AsyncIterator[bytes],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Each packed ``LookupRequest`` of the stream answered in turn by a ``LookupResponse`` with its sequence,
        a refused one by a refusal (``packed.encode_refusal``: the stream goes on); bytes that are no packed
        request end the stream with INVALID_ARGUMENT (no sequence to answer)."""
        async for raw in requests:
            try:
                with self._in_flight():
                    reply = await self._answered(raw, stream=True)
            except _Refusal as refusal:
                await _abort(context, refusal.code, refusal.details)
            yield reply

    @contextmanager
    def _in_flight(self) -> Iterator[None]:
        """A lookup counted in ``lookups_in_flight`` and busy time."""
        if not self.lookups_in_flight:
            self._busy_since = time.monotonic()
        self.lookups_in_flight += 1
        try:
            yield
        finally:
            self.lookups_in_flight -= 1
            if not self.lookups_in_flight:
                self._busy_seconds += time.monotonic() - self._busy_since

    async def _answered(self, raw: bytes, *, stream: bool) -> bytes:
        """``answer(raw)``, on the event loop for at most ``inline_max_ids`` ids, else in the pool (a call that
        ends while queued for a worker is dropped from the queue)."""
        if len(raw) <= self._inline_max_ids * 4:  # int32 ids: a bound on the ids, not counting the framing
            reply = self.answer(raw, stream=stream)
        else:
            reply = await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(
                self.answer, raw, stream=stream))
        self.bytes_received += len(raw)
        self.bytes_sent += len(reply)
        return reply

    def busy_seconds(self) -> float:
        """Wall time with at least one lookup in flight (a ``Lookup`` call or a ``LookupStream`` message being
        answered), the current spell included (the autoscaling metric)."""
        current = time.monotonic() - self._busy_since if self.lookups_in_flight else 0.0
        return self._busy_seconds + current

    def answer(self, raw: bytes, *, stream: bool = False) -> bytes:
        """The serialized reply to the serialized ``LookupRequest`` ``raw``; raises ``_Refusal`` with the status a
        refused call ends with. On a stream (``stream``): packed requests only, and a refusal of a request that
        could be read is the reply (``packed.encode_refusal``, with its sequence)."""
        try:
            request = packed.parse_request(raw, max_elements=self._max_elements)
        except ValueError as error:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"malformed LookupRequest message: {error}") from error
        if request is None:
            if stream:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "LookupStream takes packed requests (ids, counts)")
            try:
                return self._named_reply(pb.LookupRequest.FromString(raw)).SerializeToString()
            except DecodeError as error:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"malformed LookupRequest message: {error}") from error
        try:
            dtype = self._output_dtype(request.output_dtype)
            try:
                parts = self._packed_parts(request)
            except ValueError as error:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error
            rows, widths = self._packed_rows(parts, dtype)
        except _Refusal as refusal:
            if not stream:
                raise
            return packed.encode_refusal(request.sequence, refusal.code.value[0], _cut(refusal.details))
        return packed.encode_reply(rows, widths, self._shard.version, request.sequence)

    def _output_dtype(self, name: str) -> torch.dtype:
        dtype = wire.ROW_DTYPES.get(name)
        if dtype is None:
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"output_dtype {_shorten(name)} is not one of {', '.join(wire.ROW_DTYPE_NAMES)} (empty means float32)",
            )
        return dtype

    def _named_reply(self, request: pb.LookupRequest) -> pb.LookupResponse:
        dtype = self._output_dtype(request.output_dtype)
        try:
            inputs = self._named_inputs(request)
        except ValueError as error:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error
        outputs = self._run(inputs)
        try:
            selected = {name: _cast(outputs[name], dtype) for name in self._shard.output_names}
            encoded = wire.encode_all(selected, max_elements=self._max_elements)
        except (KeyError, TypeError, ValueError) as error:  # the module broke its contract, not the request
            raise _Refusal(grpc.StatusCode.INTERNAL, f"shard {self._shard.index} output: {error!r}") from error
        return pb.LookupResponse(outputs=encoded, version=self._shard.version)

    def _named_inputs(self, request: pb.LookupRequest) -> dict[str, torch.Tensor]:
        """One tensor per input name; ValueError naming what is wrong."""
        if problem := self._name_problem([message.name for message in request.inputs]):
            raise ValueError(problem)
        _check_spans(request.inputs, self._max_elements)
        return wire.decode_all(request.inputs, max_elements=self._max_elements)

    def _packed_parts(self, request: packed.PackedRequest) -> list[torch.Tensor]:
        """The packed ``ids`` split by ``counts`` into the inputs, in input-name order (views, no copy)."""
        names = self._shard.input_names
        ids, counts = request.ids, request.counts
        if ids.dim() != 1:
            raise ValueError(f"shard {self._shard.index}: packed ids must be 1-D, got shape {list(ids.shape)}")
        if len(counts) != len(names) or sum(counts) != ids.shape[0]:
            raise ValueError(
                f"shard {self._shard.index}: counts must give the ids of each of the {len(names)} inputs "
                f"({', '.join(names)}) and add up to the {ids.shape[0]} packed ids; got {len(counts)} counts "
                f"summing to {sum(counts)}"
            )
        return list(ids.split(counts))

    def _packed_rows(self, parts: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
        """Every input's rows flattened into one ``dtype`` tensor, and each output's width. A shard with ``gather``
        writes them there at once; any other runs its module, whose output ``i`` must be [counts[i], width]."""
        if self._gather is not None:
            try:
                return self._gather(parts, dtype), self._widths
            except Exception as error:  # ids out of their slices, wrong dtypes: the request's fault
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"shard {self._shard.index}: {error}") from error
        outputs = self._run(dict(zip(self._shard.input_names, parts, strict=True)))
        widths = []
        for name, part in zip(self._shard.output_names, parts, strict=True):
            output = outputs.get(name) if isinstance(outputs, Mapping) else None
            if output is None or output.dim() != 2 or output.shape[0] != part.shape[0]:
                shape = None if output is None else list(output.shape)
                raise _Refusal(grpc.StatusCode.INTERNAL, f"shard {self._shard.index} output: packed replies need "
                                                         f"output {name!r} to be [{part.shape[0]}, width], got {shape}")
            widths.append(output.shape[1])
        flat = [outputs[name].reshape(-1) for name in self._shard.output_names]
        return _cast(torch.cat(flat) if flat else torch.empty(0), dtype), widths

    def _name_problem(self, names: Sequence[str]) -> str | None:
        """What is wrong with the input names, before any tensor is decoded; names at most ``_LISTED`` unknown
        ones (a request may carry millions)."""
        present = set(names)
        missing = [name for name in self._shard.input_names if name not in present]
        unknown = [name for name in dict.fromkeys(names) if name not in self._expected]
        if not missing and not unknown:
            return None
        parts = [f"missing input {name!r}" for name in missing]
        parts += [f"unknown input {_shorten(name)}" for name in unknown[:_LISTED]]
        if len(unknown) > _LISTED:
            parts.append(f"{len(unknown) - _LISTED} more unknown inputs")
        return f"shard {self._shard.index}: {'; '.join(parts)}; expected inputs: {', '.join(self._shard.input_names)}"

    def _run(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """The shard module's outputs; its error for bad ids (out of their slices, wrong ranks or dtypes) is the
        request's fault."""
        try:
            with torch.inference_mode():  # the shard's module checks its ids (``TableLookup``: each in its slice)
                return self._shard.module(**inputs)
        except Exception as error:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                           f"shard {self._shard.index}: {error} (inputs: {_describe(inputs)})") from error


def _check_spans(messages: Iterable[pb.Tensor], max_elements: int) -> None:
    """ValueError for an empty tensor whose other dimensions exceed ``max_elements``: shape [2**40, 26, 0] has no
    element, yet a module pooling its last dimension would return 2**40 rows (and [0, 2**62, 2**62] overflows)."""
    for message in messages:
        if len(message.shape) > wire.MAX_DIMS or 0 not in message.shape:  # wire refuses or caps them
            continue
        span = math.prod(max(dim, 1) for dim in message.shape)
        if span > max_elements:
            raise ValueError(
                f"tensor {message.name!r}: empty shape {list(message.shape)} spans {span} elements counting its "
                f"empty dimensions as 1, at most {max_elements} allowed"
            )


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


class _Refusal(Exception):
    """A refused ``Lookup``: the status code and details the call ends with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End the call with ``code``; ``details`` cut to what a status trailer carries (it may echo request text)."""
    await context.abort(code, _cut(details))


def _cut(details: str) -> str:
    """``details`` cut to what a status trailer carries."""
    return details if len(details) <= _MAX_DETAILS else details[: _MAX_DETAILS - 3] + "..."


def _shorten(name: str) -> str:
    return repr(name) if len(name) <= _MAX_NAME else f"{name[:_MAX_NAME]!r}... ({len(name)} characters)"


def _describe(inputs: Mapping[str, torch.Tensor]) -> str:
    return ", ".join(f"{name} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for name, t in inputs.items())


class EmbeddingServer:
    """One shard served over ``grpc.aio`` with health checking; loopback unless ``host`` says otherwise.

    ``tls`` serves TLS instead of plaintext; a non-empty ``token`` makes ``Lookup`` and ``Info`` demand it. A
    ``host`` that is neither loopback nor private needs one of the two (ValueError otherwise).
    """

    def __init__(
        self,
        shard: Shard,
        *,
        model: str = "",
        num_shards: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_tensor_elements: int = wire.DEFAULT_MAX_ELEMENTS,
        worker_threads: int = 2,
        inline_max_ids: int = INLINE_MAX_IDS,
        torch_threads: int | None = None,
        tls: ServerTLS | None = None,
        token: str = "",
    ) -> None:
        if problem := exposure_problem(host, secured=tls is not None or bool(token)):
            raise ValueError(f"host: {problem}")
        self._shard = shard
        self._info = pb.ShardInfo(
            model=model,
            shard_index=shard.index,
            num_shards=num_shards,
            input_names=shard.input_names,
            output_names=shard.output_names,
            parameter_bytes=shard.parameter_bytes,
            version=shard.version,
        )
        self._host = host
        self._port = port
        self._max_message_bytes = max_message_bytes
        self._max_tensor_elements = max_tensor_elements
        self._worker_threads = worker_threads
        self._inline_max_ids = inline_max_ids
        self._torch_threads = torch_threads
        self._tls = tls
        self._token = _BearerToken(token) if token else None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._servicer: _Servicer | None = None

    @property
    def lookups_in_flight(self) -> int:
        """Lookups (calls and stream messages) received and not answered yet (the autoscaling load signal); 0 before
        ``start``."""
        return 0 if self._servicer is None else self._servicer.lookups_in_flight

    @property
    def busy_seconds(self) -> float:
        """Seconds with at least one lookup in flight since ``start`` (non-decreasing; autoscaling reads its rate)."""
        return 0.0 if self._servicer is None else self._servicer.busy_seconds()

    @property
    def traffic(self) -> tuple[int, int]:
        """Bytes of the lookups answered since ``start``: serialized requests received and replies sent."""
        return (0, 0) if self._servicer is None else (self._servicer.bytes_received, self._servicer.bytes_sent)

    @property
    def address(self) -> str:
        """``host:port`` as bound (an IPv6 host in brackets); only meaningful after ``start``."""
        return host_port(self._host, self._port)

    @property
    def security(self) -> str:
        """How callers are checked, for logs: ``plaintext``, ``TLS`` or ``mutual TLS``, plus ``token required``."""
        transport = "plaintext" if self._tls is None else "mutual TLS" if self._tls.client_ca is not None else "TLS"
        return transport if self._token is None else f"{transport}, token required"

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (the chosen one when ``port`` was 0)."""
        set_torch_threads(self._torch_threads)
        self._pool = ThreadPoolExecutor(self._worker_threads, thread_name_prefix=f"embedding-shard-{self._shard.index}")
        servicer = self._servicer = _Servicer(
            self._shard, self._info, self._pool, self._max_tensor_elements, self._token, self._inline_max_ids
        )
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.max_send_message_length", self._max_message_bytes),
            ]
        )
        handlers = servicer.method_handlers()
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self._server.add_registered_method_handlers(SERVICE_NAME, handlers)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._port = self._bind()
        await self._server.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self._port

    def _bind(self) -> int:
        address = host_port(self._host, self._port)
        if self._tls is None:
            return self._server.add_insecure_port(address)
        try:
            return self._server.add_secure_port(address, self._tls.credentials())
        except RuntimeError:
            raise RuntimeError(
                f"cannot serve TLS on {address}: the TLS certificate or key is invalid or they do not match, or "
                "the address cannot be bound (GRPC_VERBOSITY=debug tells which)"
            ) from None

    async def stop(self, grace: float | None = 1.0, *, drain_s: float = 0.0) -> None:
        """Report NOT_SERVING, keep serving ``drain_s`` seconds so health-checking balancers move away,
        then refuse new calls and give in-flight ones ``grace`` seconds to finish."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        await asyncio.sleep(drain_s)
        await self._server.stop(grace)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._server = None


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The CLI's arguments, with ``tls`` (a ``ServerTLS`` or None) read from the ``--tls-*`` files; exits naming
    the flag when a file cannot be read or ``--host`` would be exposed without TLS or a token, and ``layout`` (a
    ``disagg.tables.TableLayout``) from the shard flags."""
    from disagg.tables import STORAGE_DTYPES, TableLayout

    parser = argparse.ArgumentParser(description="Serve one shard of a DLRM preset's embedding table rows over gRPC.")
    parser.add_argument("--preset", default="tiny", help="DLRM preset (disagg.spec.PRESETS)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the deterministic weight initialisation")
    parser.add_argument("--shard", type=int, required=True, help="index of the shard to serve")
    parser.add_argument("--num-shards", type=int, required=True, help="number of shards the tables are spread over")
    parser.add_argument(
        "--row-wise-min-mb",
        type=float,
        default=None,
        help="split tables above this many MiB of float32 row-wise over every shard (default: keep tables whole)",
    )
    parser.add_argument(
        "--storage-dtype", choices=STORAGE_DTYPES, default="float32", help="how the shard stores its rows"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: loopback only); one that is neither loopback "
        "nor private needs TLS or SWIFTSERVE_EMBEDDING_TOKEN",
    )
    parser.add_argument("--port", type=int, default=50051, help="port to bind; 0 picks a free one")
    parser.add_argument("--max-message-mb", type=int, default=DEFAULT_MAX_MESSAGE_BYTES // MiB)
    parser.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", help="PEM CA certificates: demand client certificates they signed (mTLS)")
    args = parser.parse_args(argv)
    try:
        args.tls = _tls_from_flags(args)
    except ValueError as error:
        parser.error(str(error))
    try:
        min_bytes = None if args.row_wise_min_mb is None else int(args.row_wise_min_mb * MiB)
        args.layout = TableLayout(args.num_shards, row_wise_min_bytes=min_bytes, storage_dtype=args.storage_dtype)
    except ValueError as error:
        parser.error(str(error))  # names num_shards or row_wise_min_bytes
    if not 0 <= args.shard < args.num_shards:
        parser.error(f"--shard must be in [0, {args.num_shards}), got {args.shard}")
    if problem := exposure_problem(args.host, secured=args.tls is not None or bool(EMBEDDING_TOKEN)):
        parser.error(f"--host: {problem}")
    return args


def _tls_from_flags(args: argparse.Namespace) -> ServerTLS | None:
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    return ServerTLS(
        certificate_chain=read_pem(args.tls_cert, "--tls-cert"),
        private_key=read_pem(args.tls_key, "--tls-key"),
        client_ca=None if args.tls_client_ca is None else read_pem(args.tls_client_ca, "--tls-client-ca"),
    )


async def _serve(args: argparse.Namespace) -> None:
    from disagg.model_source import PresetSource
    from disagg.tables import build_embedding_shard

    shard = build_embedding_shard(PresetSource(args.preset, args.seed), args.shard, args.layout)
    server = EmbeddingServer(
        shard,
        model=args.preset,
        num_shards=args.num_shards,
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_mb * MiB,
        torch_threads=args.torch_threads,
        tls=args.tls,
        token=EMBEDDING_TOKEN,
    )
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    logger.info(
        "serving %s shard %d/%d on %s (%s): version %s, slices %s; %d %s bytes",
        args.preset, shard.index, args.num_shards, server.address, server.security, shard.version,
        ", ".join(shard.output_names), shard.parameter_bytes, args.storage_dtype,
    )  # fmt: skip
    await stopping.wait()
    logger.info("stopping shard %d on %s", shard.index, server.address)
    await server.stop()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(_serve(_parse_args(argv)))


if __name__ == "__main__":
    main()
