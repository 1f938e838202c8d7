"""Client of the embedding shards: replica failover within a deadline per shard, concurrent fan-out across shards.

A replica that fails, or refuses this client's TLS ``credentials`` or bearer ``token``, is skipped for the next;
when none answers in time the shard is ``ShardUnavailable``. Its errors carry their HTTP answer (``APIError``), so
an ingress passes them on as they are.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import torch

from disagg.rpc import packed, wire
from disagg.rpc._proto import embedding_pb2 as pb
from disagg.rpc._proto import embedding_pb2_grpc as pb_grpc
from disagg.rpc.stream import LookupStream
from serving.common.errors import APIError, retry_after
from serving.common.metrics import NO_METRICS, Metrics, RPCStatus

if TYPE_CHECKING:
    from disagg.lookup import ShardCall

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Status codes that blame the request, not the replica: raised at once, never retried elsewhere.
_REQUEST_ERRORS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})


class EmbeddingRequestError(APIError):
    """A shard refused the request (unknown input, id out of range, message too large): retrying cannot help.

    Requests are validated before they reach a shard, so the HTTP client gets a 500; ``str()`` tells what happened.
    """

    def __init__(self, shard_index: int | None, grpc_code: grpc.StatusCode, details: str) -> None:
        super().__init__(500, "internal error in the embedding lookup", code="internal_error")
        self.shard_index = shard_index
        self.grpc_code = grpc_code
        self.details = details

    def __str__(self) -> str:
        where = "embedding request" if self.shard_index is None else f"embedding shard {self.shard_index}"
        return f"{where} refused the request ({self.grpc_code.name}): {self.details}"

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.shard_index, self.grpc_code, self.details)


class ShardUnavailable(APIError):
    """No replica of shard ``shard_index`` answered within the deadline: 503 with Retry-After for the HTTP client;
    ``last_error`` (and ``str()``) says what went wrong last."""

    def __init__(self, shard_index: int, last_error: str) -> None:
        super().__init__(503, f"embedding shard {shard_index} is unavailable, retry later",
                         code="embedding_shard_unavailable", headers=retry_after(1))
        self.shard_index = shard_index
        self.last_error = last_error

    def __str__(self) -> str:
        return f"embedding shard {self.shard_index} unavailable: {self.last_error}"

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.shard_index, self.last_error)


class ShardVersionMismatch(APIError):
    """Every replica of shard ``shard_index`` that answered serves another table version than this dense replica
    expects (weights or storage changed on one side only, e.g. mid-rollout): 503 with Retry-After, never rows of
    the wrong model."""

    def __init__(self, shard_index: int, expected: str, served: str) -> None:
        super().__init__(503, f"embedding shard {shard_index} serves another model version, retry later",
                         code="embedding_version_mismatch", headers=retry_after(1))
        self.shard_index = shard_index
        self.expected = expected
        self.served = served

    def __str__(self) -> str:
        return (f"embedding shard {self.shard_index} serves table version {self.served[:12]}, this dense replica "
                f"expects {self.expected[:12]}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.shard_index, self.expected, self.served)


@dataclass
class LookupStats:
    """Outcomes and latencies of a client's calls, kept for export as metrics."""

    calls: int = 0
    request_errors: int = 0
    unavailable: int = 0
    latency_s_total: float = 0.0
    recent_latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=1024))

    def observe(self, latency_s: float) -> None:
        self.calls += 1
        self.latency_s_total += latency_s
        self.recent_latencies_s.append(latency_s)


@dataclass
class ShardStats(LookupStats):
    """``LookupStats`` of one shard's RPCs (lookups and the one-off Info) plus ``failovers`` (attempts on
    another replica after one failed), calls no replica of the expected table version answered, and the
    serialized bytes of answered calls, each way."""

    failovers: int = 0
    version_mismatches: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


class ShardClient:
    """The replicas of one shard: round-robin, fail over within the deadline on any status that does not refuse
    the request itself (UNAVAILABLE, DEADLINE_EXCEEDED, UNAUTHENTICATED, ...).

    A replica that failed is tried after the others for ``cooldown_s``. Each attempt gets at most half of the
    time left while two or more replicas remain to try, so a hanging replica leaves time for another.
    ``credentials`` (``grpc.ssl_channel_credentials``) connect to TLS servers, verifying ``server_name`` instead of
    each address's host when given; a non-empty ``token`` goes as the call metadata ``authorization: Bearer``.
    A replica answering with another table version than ``expected_version`` (when given) counts as failed; when
    no replica serves it, ``ShardVersionMismatch``. ``on_new_version(shard_index, version)`` runs whenever a reply
    reports a version other than the previous reply's (a shard restarted with other tables); it may be set later.
    ``packed`` sends every input's ids as one tensor and gets every output's rows back as one (``LookupRequest``),
    for shards whose output ``i`` has one row per id of input ``i`` (table shards): outputs are then keyed by input
    name, and the encode and decode cost no longer grows with the number of slices. Packed calls travel as raw
    bytes written and read by ``disagg.rpc.packed`` (the same protobuf messages, rows viewed where they arrived);
    ``start_packed`` creates the call before returning, so a caller can compute while it is in flight. With
    ``stream``, packed lookups go as messages on one ``LookupStream`` call per replica (``disagg.rpc.stream``),
    failing over as ``Lookup`` calls do.

    gRPC's own round-robin, retry policy (service config) and client-side health checking are not used for
    failover: the replica list changes at run time and Python's grpc cannot update a channel's addresses without a
    custom resolver, which it cannot register; its retry policy neither retries a hung replica (DEADLINE_EXCEEDED)
    nor lets the caller pick the next address; and health checking needs the round-robin policy. The servers do
    serve ``grpc.health.v1`` (NOT_SERVING while draining) for load balancers and probes; this client learns of a
    replica's end from its failed calls and from the directory. gRPC's reconnect backoff is used (channel options).
    """

    def __init__(
        self,
        shard_index: int,
        addresses: Sequence[str],
        *,
        input_names: Sequence[str] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_tensor_elements: int = wire.DEFAULT_MAX_ELEMENTS,
        cooldown_s: float = 1.0,
        max_reconnect_backoff_ms: int = 1000,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str | None = None,
        token: str = "",
        expected_version: str | None = None,
        on_new_version: Callable[[int, str], None] | None = None,
        packed: bool = False,
        stream: bool = False,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self.shard_index = shard_index
        self.packed = packed
        self.stream = stream
        self._sequences = itertools.count(1)
        self.expected_version = expected_version
        self.on_new_version = on_new_version
        self._last_version: str | None = None
        self._metrics = metrics
        self.input_names: tuple[str, ...] | None = None if input_names is None else tuple(input_names)
        self.stats = ShardStats()
        self._max_tensor_elements = max_tensor_elements
        self._cooldown_s = cooldown_s
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", min(100, max_reconnect_backoff_ms)),
            ("grpc.min_reconnect_backoff_ms", min(100, max_reconnect_backoff_ms)),
            ("grpc.max_reconnect_backoff_ms", max_reconnect_backoff_ms),
        ]
        if server_name is not None:
            self._options.append(("grpc.ssl_target_name_override", server_name))
        self._credentials = credentials
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._addresses: tuple[str, ...] = ()
        self._stubs: dict[str, _Replica] = {}
        self._cooling_until: dict[str, float] = {}
        self._next = 0
        self._retired: list[grpc.aio.Channel] = []
        self._closing: set[asyncio.Task[None]] = set()
        self.update_addresses(addresses)

    @property
    def addresses(self) -> tuple[str, ...]:
        return self._addresses

    def update_addresses(self, addresses: Sequence[str]) -> None:
        """Serve from ``addresses`` from now on; channels of removed replicas close (in-flight calls fail over)."""
        self._addresses = tuple(dict.fromkeys(addresses))
        for address in set(self._stubs) - set(self._addresses):
            replica = self._stubs.pop(address)
            replica.stream.close()
            self._retired.append(replica.channel)
            self._cooling_until.pop(address, None)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop running: close() closes them
            return
        while self._retired:
            task = asyncio.create_task(self._retired.pop().close(grace=1.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def info(self, *, timeout_s: float) -> pb.ShardInfo:
        """The shard's self-description; remembers its ``input_names``."""
        info = await self._call("Info", pb.InfoRequest(), timeout_s)
        self.input_names = tuple(info.input_names)
        return info

    async def lookup(
        self, inputs: Mapping[str, torch.Tensor], *, timeout_s: float, output_dtype: str = ""
    ) -> dict[str, torch.Tensor]:
        """The shard's outputs for ``inputs`` (exactly its input names), from the first replica that answers with
        the expected table version; floating outputs in ``output_dtype`` ("" = float32)."""
        if self.packed and self.input_names is not None:
            return await self._packed_lookup(inputs, timeout_s=timeout_s, output_dtype=output_dtype)
        try:
            request = pb.LookupRequest(inputs=wire.encode_all(inputs, max_elements=self._max_tensor_elements),
                                       output_dtype=output_dtype)
        except ValueError as error:
            raise EmbeddingRequestError(self.shard_index, grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        response = await self._call("Lookup", request, timeout_s)
        return wire.decode_all(response.outputs, max_elements=self._max_tensor_elements)

    async def _packed_lookup(
        self, inputs: Mapping[str, torch.Tensor], *, timeout_s: float, output_dtype: str
    ) -> dict[str, torch.Tensor]:
        names = self.input_names
        if set(inputs) != set(names):
            raise EmbeddingRequestError(self.shard_index, grpc.StatusCode.INVALID_ARGUMENT,
                                        f"inputs must be exactly {', '.join(names)}; got {', '.join(inputs)}")
        counts = [inputs[name].numel() for name in names]
        ids = torch.cat([inputs[name].reshape(-1) for name in names])
        reply = await self.start_packed(ids, counts, timeout_s=timeout_s, output_dtype=output_dtype)
        sizes = [count * width for count, width in zip(counts, reply.widths, strict=True)]
        return {name: part.view(count, width)
                for name, part, count, width in zip(names, reply.rows.split(sizes), counts, reply.widths, strict=True)}

    def start_packed(
        self, ids: torch.Tensor, counts: Sequence[int], *, timeout_s: float, output_dtype: str = ""
    ) -> Coroutine[Any, Any, packed.PackedReply]:
        """A packed lookup, its gRPC call created before this returns (``_call``): ``ids`` (1-D) holds ``counts[i]``
        ids of input ``i`` (``input_names`` order); the awaited reply's ``rows`` hold input ``i``'s rows,
        ``widths[i]`` wide, in order (a view of the received bytes)."""
        sequence = next(self._sequences) if self.stream else 0
        try:
            request = packed.encode_request(ids, counts, output_dtype, sequence)
        except ValueError as error:
            raise EmbeddingRequestError(self.shard_index, grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        return self._checked(self._call("Lookup", request, timeout_s, sequence), list(counts))

    async def _checked(self, pending: Awaitable[packed.PackedReply], counts: list[int]) -> packed.PackedReply:
        reply = await pending
        sizes = [count * width for count, width in zip(counts, reply.widths, strict=False)]
        if len(reply.widths) != len(counts) or sum(sizes) != reply.rows.numel():
            raise EmbeddingRequestError(self.shard_index, grpc.StatusCode.INTERNAL,
                                        f"packed reply of {reply.rows.numel()} row elements and widths "
                                        f"{reply.widths} does not match the {len(counts)} inputs' counts {counts}")
        return reply

    async def close(self) -> None:
        self.update_addresses(())
        await asyncio.gather(*self._closing)

    def _call(self, method: str, request: Any, timeout_s: float, sequence: int = 0) -> Awaitable[Any]:
        """The reply to ``request`` (protobuf, or raw bytes of a packed lookup: numbered ``sequence`` on a stream)
        from the first replica that answers in time with the expected version. The first attempt's gRPC call (or
        stream message) is created before this returns, so it is on its way after the caller's next pass through
        the event loop, whatever the caller computes meanwhile."""
        start = time.monotonic()
        targets = self._targets(start + timeout_s)
        attempts = ((address, self._invoke(method, request, address, timeout, sequence))
                    for address, timeout in targets)
        first = next(attempts, None)
        return self._settle(method, request, start, timeout_s, itertools.chain([first] if first else [], attempts))

    def _targets(self, deadline: float) -> Iterator[tuple[str, float]]:
        """Replica addresses in the order to try them, each with the time its attempt may take, until the deadline;
        lazy, so each attempt gets the time left when the previous one failed."""
        for tier in self._tiers():
            for position, address in enumerate(tier):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                if address in self._addresses:  # else removed by update_addresses during this call
                    yield address, remaining / min(2, len(tier) - position)

    def _invoke(self, method: str, request: Any, address: str, timeout: float, sequence: int) -> Any:
        if isinstance(request, bytes) and self.stream:
            return asyncio.ensure_future(self._channel(address).stream.lookup(request, sequence, timeout))
        call = self._packed_call(address) if isinstance(request, bytes) else getattr(self._stub(address), method)
        return call(request, timeout=timeout, metadata=self._metadata)

    async def _settle(self, method: str, request: Any, start: float, timeout_s: float,
                      attempts: Iterator[tuple[str, Any]]) -> Any:
        last_error = "no replica addresses" if not self._addresses else f"deadline of {timeout_s:.3f}s passed"
        served: str | None = None  # the version of the last replica refused for serving another one
        raw = isinstance(request, bytes)
        for attempt, (address, call) in enumerate(attempts):
            if attempt:
                self.stats.failovers += 1
                self._metrics.embedding_failover(self.shard_index)
            try:
                response = await call
            except grpc.aio.AioRpcError as error:
                if error.code() in _REQUEST_ERRORS:
                    self.stats.request_errors += 1
                    self._observe(method, "request_error", start)
                    raise EmbeddingRequestError(self.shard_index, error.code(), error.details()) from None
                last_error, served = f"{address}: {error.code().name}: {error.details()}", None
                if address in self._addresses:
                    self._cooling_until[address] = time.monotonic() + self._cooldown_s
                continue
            sent, received = (len(request), len(response)) if raw else (request.ByteSize(), response.ByteSize())
            if raw:
                try:
                    response = packed.parse_reply(response, max_elements=self._max_tensor_elements)
                except ValueError as error:
                    self.stats.request_errors += 1
                    self._observe(method, "request_error", start)
                    raise EmbeddingRequestError(self.shard_index, grpc.StatusCode.INTERNAL,
                                                f"{address}: {error}") from None
            if mismatch := self._version_problem(getattr(response, "version", None)):
                last_error, served = f"{address}: {mismatch}", response.version
                self._cooling_until[address] = time.monotonic() + self._cooldown_s
                continue
            self._cooling_until.pop(address, None)
            self._observe(method, "ok", start)
            self.stats.bytes_sent += sent
            self.stats.bytes_received += received
            self._metrics.embedding_bytes("sent", sent)
            self._metrics.embedding_bytes("received", received)
            return response
        if served is not None and self.expected_version is not None:
            self.stats.version_mismatches += 1
            self._observe(method, "version_mismatch", start)
            raise ShardVersionMismatch(self.shard_index, self.expected_version, served)
        self.stats.unavailable += 1
        self._observe(method, "unavailable", start)
        raise ShardUnavailable(self.shard_index, last_error)

    def _version_problem(self, version: str | None) -> str | None:
        """Why a reply of table ``version`` cannot be used (None: it can); tells ``on_new_version`` of a change."""
        if not version:  # Info replies carry none
            return None
        if version != self._last_version:
            if self._last_version is not None and self.on_new_version is not None:
                self.on_new_version(self.shard_index, version)
            self._last_version = version
        if self.expected_version is not None and version != self.expected_version:
            return f"serves table version {version[:12]}, expected {self.expected_version[:12]}"
        return None

    def _observe(self, method: str, status: RPCStatus, start: float) -> None:
        elapsed = time.monotonic() - start
        self.stats.observe(elapsed)
        self._metrics.embedding_rpc(self.shard_index, method, status, elapsed)

    def _tiers(self) -> tuple[list[str], list[str]]:
        """Replicas in round-robin order from a rotating start: those not cooling down, then those that are."""
        if not self._addresses:
            return [], []
        start = self._next % len(self._addresses)
        self._next += 1
        rotated = self._addresses[start:] + self._addresses[:start]
        now = time.monotonic()
        cooling = sorted((a for a in rotated if self._cooling_until.get(a, 0.0) > now), key=self._cooling_until.get)
        return [a for a in rotated if a not in cooling], cooling

    def _stub(self, address: str) -> pb_grpc.EmbeddingShardStub:
        return self._channel(address).stub

    def _packed_call(self, address: str) -> grpc.aio.UnaryUnaryMultiCallable:
        """``Lookup`` on raw bytes both ways (``disagg.rpc.packed`` writes and reads them)."""
        return self._channel(address).lookup

    def _channel(self, address: str) -> _Replica:
        if address not in self._stubs:
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=self._options)
            else:
                channel = grpc.aio.secure_channel(address, self._credentials, options=self._options)
            lookup = channel.unary_unary(f"/{wire.SERVICE_NAME}/Lookup", _registered_method=True)
            open_stream = channel.stream_stream(f"/{wire.SERVICE_NAME}/LookupStream", _registered_method=True)
            stream = LookupStream(lambda: open_stream(metadata=self._metadata))
            self._stubs[address] = _Replica(channel, pb_grpc.EmbeddingShardStub(channel), lookup, stream)
        return self._stubs[address]


@dataclass(frozen=True)
class _Replica:
    """One replica's channel and what calls it: the protobuf stub, raw-bytes ``Lookup``, the ``LookupStream``."""

    channel: grpc.aio.Channel
    stub: pb_grpc.EmbeddingShardStub
    lookup: grpc.aio.UnaryUnaryMultiCallable
    stream: LookupStream


class EmbeddingClient:
    """All shards of a model: each lookup goes to every shard concerned at once, each getting only its inputs."""

    def __init__(self, shards: Sequence[ShardClient]) -> None:
        self.shards = tuple(shards)
        self.stats = LookupStats()

    async def lookup(
        self, inputs: Mapping[str, torch.Tensor], *, timeout_s: float, output_dtype: str = ""
    ) -> dict[str, torch.Tensor]:
        """Every called shard's outputs merged; a shard whose inputs are all empty is not called (its outputs are
        left out). The first shard to fail cancels the others and its error propagates."""
        deadline = time.monotonic() + timeout_s
        with self._counted():
            await _all(s.info(timeout_s=deadline - time.monotonic()) for s in self.shards if s.input_names is None)
            routed = self._route(inputs)
            results = await _all(
                shard.lookup(shard_inputs, timeout_s=deadline - time.monotonic(), output_dtype=output_dtype)
                for shard, shard_inputs in routed
                if any(tensor.numel() for tensor in shard_inputs.values())
            )
        return {name: tensor for outputs in results for name, tensor in outputs.items()}

    def start_packed(
        self, calls: Sequence[ShardCall], *, timeout_s: float, output_dtype: str = ""
    ) -> Awaitable[list[packed.PackedReply]]:
        """Every packed call's reply, in order (``ShardClient.start_packed``), every gRPC call created before this
        returns: await the replies. The first to fail cancels the others and its error propagates."""
        pending: list[Coroutine[Any, Any, packed.PackedReply]] = []
        try:
            for call in calls:
                pending.append(self.shards[call.shard].start_packed(call.ids, call.counts, timeout_s=timeout_s,
                                                                    output_dtype=output_dtype))
        except EmbeddingRequestError:
            for started in pending:
                started.close()
            self.stats.request_errors += 1
            raise
        return self._gathered(pending)

    async def _gathered(self, pending: list[Coroutine[Any, Any, packed.PackedReply]]) -> list[packed.PackedReply]:
        with self._counted():
            return await _all(pending)

    @contextmanager
    def _counted(self) -> Iterator[None]:
        """``stats`` of one lookup: its time, and its error by kind."""
        start = time.monotonic()
        try:
            yield
        except EmbeddingRequestError:
            self.stats.request_errors += 1
            raise
        except (ShardUnavailable, ShardVersionMismatch):
            self.stats.unavailable += 1
            raise
        finally:
            self.stats.observe(time.monotonic() - start)

    async def close(self) -> None:
        await asyncio.gather(*(shard.close() for shard in self.shards))

    def _route(self, inputs: Mapping[str, torch.Tensor]) -> list[tuple[ShardClient, dict[str, torch.Tensor]]]:
        routed = []
        for shard in self.shards:
            missing = [name for name in shard.input_names if name not in inputs]
            if missing:
                raise EmbeddingRequestError(
                    shard.shard_index, grpc.StatusCode.INVALID_ARGUMENT, f"missing input {missing[0]!r}"
                )
            routed.append((shard, {name: inputs[name] for name in shard.input_names}))
        needed = {name for shard in self.shards for name in shard.input_names}
        if unknown := sorted(set(inputs) - needed):
            raise EmbeddingRequestError(None, grpc.StatusCode.INVALID_ARGUMENT, f"unknown input {unknown[0]!r}")
        return routed


async def _all(calls: Any) -> list[Any]:
    """Run ``calls`` concurrently; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
