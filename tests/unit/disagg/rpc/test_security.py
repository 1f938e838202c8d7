"""The embedding service facing hostile peers: TLS and mutual TLS, the shared token, the exposure policy, and
malformed or oversized messages (refused with a status naming the problem; the server keeps serving the right
rows and its tables are untouched)."""

from __future__ import annotations

import asyncio
import hashlib
import runpy
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from disagg.config import DLRMAppConfig, EmbeddingServiceConfig
from disagg.deployments.shards import EmbeddingShardServer
from disagg.model_source import PresetSource
from disagg.rpc import server as embedding_server
from disagg.rpc import wire
from disagg.rpc._proto import embedding_pb2 as pb
from disagg.rpc.client import ShardClient, ShardUnavailable
from disagg.rpc.server import SERVICE_NAME, EmbeddingServer, exposure_problem
from disagg.rpc.tls import ServerTLS, channel_credentials, server_tls
from disagg.tables import TableLayout, TableShard, build_embedding_shard
from serving.common import constants
from tests.helpers.embedding_shards import serving, toy_inputs, toy_shard
from tests.helpers.pki import PKI, make_pki, trusting

TOKEN = "3mb-t0ken-never-logged"
LOOKUP = f"/{SERVICE_NAME}/Lookup"
INFO = f"/{SERVICE_NAME}/Info"


# --- throwaway PKI ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_material(pki: PKI, *, mutual: bool = False) -> ServerTLS:
    return ServerTLS(pki.cert.read_bytes(), pki.key.read_bytes(), pki.ca.read_bytes() if mutual else None)


def tls_config(pki: PKI, **settings) -> EmbeddingServiceConfig:
    return EmbeddingServiceConfig(
        tls_cert_file=str(pki.cert), tls_key_file=str(pki.key), tls_ca_file=str(pki.ca), **settings
    )


async def lookup_via(address: str, **client_options) -> dict[str, torch.Tensor]:
    """The toy shard's lookup through a ShardClient; ShardUnavailable when the replica refused it."""
    client = ShardClient(0, [address], **client_options)
    try:
        return await client.lookup(toy_inputs(toy_shard()), timeout_s=5)
    finally:
        await client.close()


def assert_same(outputs: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert outputs.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(outputs[name], tensor, rtol=0, atol=0)


async def assert_refused(address: str, **client_options) -> ShardUnavailable:
    with pytest.raises(ShardUnavailable) as info:
        await lookup_via(address, **client_options)
    return info.value


# --- TLS ----------------------------------------------------------------------------------------------------------


def test_tls_answers_clients_trusting_its_ca_only(pki: PKI):
    async def body():
        shard = toy_shard()
        async with serving(shard, tls=tls_material(pki)) as server:
            assert_same(
                await lookup_via(server.address, credentials=trusting(pki.ca)), shard.module(**toy_inputs(shard))
            )
            plaintext = await assert_refused(server.address)
            stranger = await assert_refused(server.address, credentials=trusting(pki.other_ca))
        assert "UNAVAILABLE" in plaintext.last_error and "UNAVAILABLE" in stranger.last_error

    asyncio.run(body())


def test_mutual_tls_refuses_clients_without_a_certificate_its_ca_signed(pki: PKI):
    async def body():
        config = tls_config(pki, tls_client_auth=True)  # the path deployments take
        shard = toy_shard()
        async with serving(shard, tls=server_tls(config)) as server:
            outputs = await lookup_via(server.address, credentials=channel_credentials(config))
            await assert_refused(server.address, credentials=trusting(pki.ca))  # no client certificate
            await assert_refused(server.address, credentials=trusting(pki.ca, pki.other_cert, pki.other_key))
        assert_same(outputs, shard.module(**toy_inputs(shard)))

    asyncio.run(body())


def test_server_name_lets_one_certificate_serve_every_address(pki: PKI):
    async def body():
        tls = ServerTLS(pki.named_cert.read_bytes(), pki.named_key.read_bytes())
        async with serving(toy_shard(), tls=tls) as server:  # the certificate names embedding.internal, not the IP
            await lookup_via(server.address, credentials=trusting(pki.ca), server_name="embedding.internal")
            await assert_refused(server.address, credentials=trusting(pki.ca))

    asyncio.run(body())


def test_a_key_that_does_not_match_the_certificate_fails_the_start_saying_so(pki: PKI):
    async def body():
        server = EmbeddingServer(toy_shard(), tls=ServerTLS(pki.cert.read_bytes(), pki.other_key.read_bytes()))
        with pytest.raises(RuntimeError, match="TLS certificate or key is invalid or they do not match"):
            await server.start()

    asyncio.run(body())


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"tls_cert_file": "/etc/cert.pem"}, "missing: tls_key_file, tls_ca_file"),
        ({"tls_cert_file": "/c.pem", "tls_key_file": "/k.pem"}, "missing: tls_ca_file"),
        ({"tls_client_auth": True}, "tls_client_auth and tls_server_name need TLS"),
        ({"tls_server_name": "embedding.internal"}, "tls_client_auth and tls_server_name need TLS"),
        (
            {"tls_cert_file": "cert.pem", "tls_key_file": "/k.pem", "tls_ca_file": "/ca.pem"},
            "tls_cert_file\n.*absolute",
        ),
        (
            {"tls_cert_file": "/c", "tls_key_file": "/k", "tls_ca_file": "/a", "tls_server_name": "a b"},
            "tls_server_name",
        ),
    ],
)
def test_incomplete_or_relative_tls_settings_are_refused(settings: dict, error: str):
    with pytest.raises(ValidationError, match=error):
        DLRMAppConfig.model_validate({"embedding": settings})


def test_plaintext_config_has_no_tls_material():
    config = EmbeddingServiceConfig()
    assert (config.tls, server_tls(config), channel_credentials(config)) == (False, None, None)


@pytest.mark.parametrize("field", ["tls_cert_file", "tls_key_file", "tls_ca_file"])
def test_a_missing_or_non_pem_tls_file_is_refused_naming_its_field(pki: PKI, tmp_path: Path, field: str):
    missing = tls_config(pki, tls_client_auth=True).model_copy(update={field: str(tmp_path / "absent.pem")})
    with pytest.raises(ValueError, match=rf"^embedding\.{field}: cannot read .*absent\.pem: No such file"):
        server_tls(missing)
    with pytest.raises(ValueError, match=rf"^embedding\.{field}: cannot read"):
        channel_credentials(missing)
    (tmp_path / "text.pem").write_text("not a certificate")
    garbled = missing.model_copy(update={field: str(tmp_path / "text.pem")})
    with pytest.raises(ValueError, match=rf"^embedding\.{field}: .*text\.pem holds no PEM block"):
        server_tls(garbled)


# --- shared token -------------------------------------------------------------------------------------------------


async def raw_call(server: EmbeddingServer, method: str, request: bytes, metadata=None) -> bytes:
    """One call with the request's bytes as they are: no client-side serialization or check."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        return await call(request, timeout=5, metadata=metadata)


def lookup_bytes(inputs: dict[str, torch.Tensor]) -> bytes:
    return pb.LookupRequest(inputs=wire.encode_all(inputs)).SerializeToString()


@pytest.mark.parametrize(
    ("metadata", "details"),
    [
        (None, "missing token"),
        ((("authorization", "Bearer wrong-token"),), "invalid token"),
        ((("authorization", f"Bearer {TOKEN}x"),), "invalid token"),
        ((("authorization", f"Bearer {TOKEN[:-1]}"),), "invalid token"),
        ((("authorization", f"Basic {TOKEN}"),), "must be `Bearer <token>`"),
        ((("authorization", TOKEN),), "must be `Bearer <token>`"),
        ((("x-token", TOKEN),), "missing token"),
    ],
)
def test_lookup_and_info_without_the_token_are_unauthenticated(metadata, details: str):
    async def body():
        shard = toy_shard()
        async with serving(shard, token=TOKEN) as server:
            for method, request in ((LOOKUP, lookup_bytes(toy_inputs(shard))), (INFO, b"")):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await raw_call(server, method, request, metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert details in info.value.details() and TOKEN not in info.value.details()
        assert shard.module.calls == 0

    asyncio.run(body())


def test_the_right_token_is_accepted_and_health_checks_need_none():
    async def body():
        shard = toy_shard()
        async with serving(shard, token=TOKEN) as server:
            for scheme in ("Bearer", "bearer"):
                raw = await raw_call(
                    server, LOOKUP, lookup_bytes(toy_inputs(shard)), (("authorization", f"{scheme} {TOKEN}"),)
                )
                outputs = wire.decode_all(pb.LookupResponse.FromString(raw).outputs)
                assert_same(outputs, shard.module(**toy_inputs(shard)))
            async with grpc.aio.insecure_channel(server.address) as channel:
                response = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
                )
        assert response.status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(body())


def test_an_unauthenticated_call_is_refused_before_its_message_is_parsed():
    async def body():
        async with serving(toy_shard(), token=TOKEN) as server:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_call(server, LOOKUP, b"\xff\xfe not a message")
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(body())


def test_the_client_sends_its_token_and_fails_over_from_a_replica_refusing_it():
    async def body():
        shard = toy_shard()
        async with serving(shard, token="old-token") as old, serving(shard, token=TOKEN) as new:
            client = ShardClient(0, [old.address, new.address], token=TOKEN, cooldown_s=60)
            try:
                for _ in range(2):  # round robin: one lookup starts on the replica with the other token
                    assert_same(await client.lookup(toy_inputs(shard), timeout_s=5), shard.module(**toy_inputs(shard)))
            finally:
                await client.close()
            refused = await assert_refused(new.address, token="wrong-token")
            untokened = await assert_refused(new.address)
        assert client.stats.failovers == 1
        assert "UNAUTHENTICATED: invalid token" in refused.last_error
        assert "UNAUTHENTICATED: missing token" in untokened.last_error

    asyncio.run(body())


def test_neither_the_token_nor_a_presented_one_is_logged(all_logs: pytest.LogCaptureFixture, capfd):
    presented = "presented-secret-t0ken"

    async def body():
        shard = toy_shard()
        async with serving(shard, token=TOKEN) as server:
            await lookup_via(server.address, token=TOKEN)
            for token in (presented, f"{TOKEN}x"):
                await assert_refused(server.address, token=token)
            with pytest.raises(grpc.aio.AioRpcError):
                await raw_call(server, INFO, b"", (("authorization", f"Basic {TOKEN}"),))

    asyncio.run(body())
    logged = "\n".join(record.getMessage() for record in all_logs.records)
    assert "refused Lookup from ipv4:127.0.0.1:" in logged and ": wrong token" in logged  # refusals are logged ...
    assert "refused Info from" in logged and ": not a Bearer token" in logged
    printed = capfd.readouterr()
    for text in (logged, printed.out, printed.err):
        assert TOKEN not in text and presented not in text  # ... without any secret


@pytest.mark.parametrize("token", ["clé", "two words", "tab\there"])
def test_a_token_grpc_metadata_cannot_carry_is_refused_at_construction(token: str):
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        EmbeddingServer(toy_shard(), token=token)


@pytest.mark.parametrize(("value", "expected"), [(None, ""), ("", ""), (" \n", ""), (f"{TOKEN}\n", TOKEN)])
def test_the_token_comes_from_swiftserve_embedding_token(monkeypatch, value: str | None, expected: str):
    if value is None:
        monkeypatch.delenv("SWIFTSERVE_EMBEDDING_TOKEN", raising=False)
    else:
        monkeypatch.setenv("SWIFTSERVE_EMBEDDING_TOKEN", value)
    fresh = runpy.run_path(str(Path(constants.__file__)))  # the module itself is left alone
    assert fresh["EMBEDDING_TOKEN"] == expected


# --- exposure policy ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "127.3.0.9", "::1", "localhost", "10.1.2.3", "172.16.5.4", "192.168.0.7", "fd00::2", "[fd12::1]"],
)
def test_loopback_and_private_addresses_may_serve_plaintext(host: str):
    assert exposure_problem(host, secured=False) is None


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "[::]", "8.8.8.8", "172.32.0.1", "2001:4860::8888", "::ffff:8.8.8.8", "shards.example"]
)
def test_wildcard_public_and_named_addresses_need_tls_or_a_token(host: str):
    assert exposure_problem(host, secured=False) == (
        f"{host!r} is neither a loopback nor a private address; serving there needs TLS or a token "
        "(SWIFTSERVE_EMBEDDING_TOKEN)"
    )
    assert exposure_problem(host, secured=True) is None


def test_the_server_refuses_an_exposed_address_without_tls_or_a_token(pki: PKI):
    with pytest.raises(ValueError, match=r"^host: '0\.0\.0\.0' is neither a loopback nor a private address"):
        EmbeddingServer(toy_shard(), host="0.0.0.0")
    EmbeddingServer(toy_shard(), host="0.0.0.0", token=TOKEN)  # accepted (not started: tests bind loopback only)
    EmbeddingServer(toy_shard(), host="0.0.0.0", tls=tls_material(pki))


CLI = ["--shard", "0", "--num-shards", "2"]


def test_cli_refuses_an_exposed_host_naming_the_flag(capsys, monkeypatch):
    monkeypatch.setattr(embedding_server, "EMBEDDING_TOKEN", "")
    with pytest.raises(SystemExit):
        embedding_server._parse_args([*CLI, "--host", "0.0.0.0"])
    assert "--host: '0.0.0.0' is neither a loopback nor a private address" in capsys.readouterr().err
    monkeypatch.setattr(embedding_server, "EMBEDDING_TOKEN", TOKEN)
    assert embedding_server._parse_args([*CLI, "--host", "0.0.0.0"]).tls is None


def test_cli_reads_tls_files_and_names_the_flag_of_a_bad_one(pki: PKI, capsys, tmp_path: Path):
    files = ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key)]
    args = embedding_server._parse_args([*CLI, "--host", "0.0.0.0", *files, "--tls-client-ca", str(pki.ca)])
    assert args.tls == ServerTLS(pki.cert.read_bytes(), pki.key.read_bytes(), pki.ca.read_bytes())
    for flags, error in [
        (["--tls-cert", str(pki.cert)], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", str(pki.ca)], "--tls-client-ca needs --tls-cert and --tls-key"),
        ([*files[:2], "--tls-key", str(tmp_path / "gone.key")], "--tls-key: cannot read"),
    ]:
        with pytest.raises(SystemExit):
            embedding_server._parse_args([*CLI, *flags])
        assert error in capsys.readouterr().err


class _NoDirectory:
    """A shard replica that got this far would announce itself: the refusals below come first."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the refused replica used the directory ({name})")


class _UnstartedReplica(EmbeddingShardServer.func_or_class):
    def __del__(self) -> None:  # refused before serving: nothing to withdraw or stop
        pass


async def start_shard_replica(embedding: dict) -> None:
    """``EmbeddingShardServer.__init__`` as Serve runs it, without Ray: only the refusals before any Ray call."""
    await _UnstartedReplica.__init__(object.__new__(_UnstartedReplica), {"embedding": embedding}, 0, _NoDirectory())


def test_a_shard_replica_refuses_an_exposed_bind_host_before_loading_its_tables(monkeypatch):
    monkeypatch.setattr("disagg.deployments.shards.build_embedding_shard", None)  # would fail if reached
    with pytest.raises(ValueError, match=r"^embedding\.bind_host \(0\.0\.0\.0\): '0\.0\.0\.0' is neither"):
        asyncio.run(start_shard_replica({"bind_host": "0.0.0.0"}))


def test_a_shard_replica_refuses_an_unreadable_tls_file_naming_its_field(pki: PKI, tmp_path: Path, monkeypatch):
    monkeypatch.setattr("disagg.deployments.shards.build_embedding_shard", None)
    files = {"tls_cert_file": str(tmp_path / "gone.pem"), "tls_key_file": str(pki.key), "tls_ca_file": str(pki.ca)}
    with pytest.raises(ValueError, match=r"^embedding\.tls_cert_file: cannot read"):
        asyncio.run(start_shard_replica({"bind_host": "0.0.0.0", **files}))


# --- hostile messages ---------------------------------------------------------------------------------------------

#: Shard 0 of the tiny DLRM over 2 shards, as the layout below plans it: 13 whole tables, ``SMALL`` the smallest.
LAYOUT = TableLayout(2, table_storage={"embeddings.8": "int8", "embeddings.4": "float16"})
SMALL, SMALL_ROWS = "embeddings.8", 3


@pytest.fixture(scope="module")
def tiny_shard() -> TableShard:
    """Shard 0 of 2 of the tiny DLRM: one 1-D int id input per table, stored in float32, float16 and int8."""
    shard = build_embedding_shard(PresetSource("tiny", 0), 0, LAYOUT)
    rows = {piece.name: piece.rows for piece in shard.slices}
    assert len(rows) == 13 and rows[SMALL] == SMALL_ROWS
    assert {store.dtype for store in shard.stores} == {"float32", "float16", "int8"}
    return shard


@pytest.fixture(scope="module")
def good_ids(tiny_shard: TableShard) -> dict[str, torch.Tensor]:
    """Valid local ids for every slice of the shard: its last row twice and its first, int32 as on the wire."""
    return {
        piece.name: torch.tensor([piece.rows - 1, 0, piece.rows - 1], dtype=torch.int32) for piece in tiny_shard.slices
    }


def checksum(shard: TableShard) -> str:
    """Digest of every stored tensor of ``shard``: values, and int8's scales and biases."""
    digest = hashlib.sha256()
    for store in shard.stores:
        for part, tensor in (("values", store.values), ("scale", store.scale), ("bias", store.bias)):
            if tensor is not None:
                digest.update(f"{store.slice.name}.{part}.{tensor.dtype}".encode())
                digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def ids(dtype: str = "int64", shape=(SMALL_ROWS,), data: bytes | None = None, name: str = SMALL) -> pb.Tensor:
    """A raw, unchecked wire tensor: ``data`` defaults to the bytes of ``SMALL_ROWS`` int64 zeros, whatever
    ``dtype`` and ``shape`` say."""
    return pb.Tensor(name=name, dtype=dtype, shape=shape, data=bytes(8 * SMALL_ROWS) if data is None else data)


def with_id(value: int, dtype: torch.dtype = torch.int64) -> pb.Tensor:
    """``SMALL``'s ids 0, ``value``, 0."""
    local = torch.zeros(SMALL_ROWS, dtype=dtype)
    local[1] = value
    return wire.encode(SMALL, local)


def request(good: dict[str, torch.Tensor], *tensors: pb.Tensor, output_dtype: str = "") -> bytes:
    """A LookupRequest of ``good`` with ``tensors`` instead of the inputs of their names (others are added)."""
    names = {tensor.name for tensor in tensors}
    inputs = [*wire.encode_all({name: ids for name, ids in good.items() if name not in names}), *tensors]
    return pb.LookupRequest(inputs=inputs, output_dtype=output_dtype).SerializeToString()


Payload = Callable[[dict[str, torch.Tensor]], bytes]
HOSTILE: dict[str, tuple[str, Payload, str]] = {
    "garbage bytes": (LOOKUP, lambda good: b"\xff\xfe\x00 garbage \x12\x99", "malformed LookupRequest message"),
    "garbage Info": (INFO, lambda good: b"\x0a\xff\xff\xff", "malformed InfoRequest message"),
    "byte count lies": (
        LOOKUP,
        lambda good: request(good, ids(data=bytes(100))),
        "tensor 'embeddings.8': data holds 100 bytes, but shape [3] of int64 needs 24",
    ),
    "unknown dtype": (
        LOOKUP,
        lambda good: request(good, ids(dtype="complex64")),
        "tensor 'embeddings.8': unknown dtype 'complex64'",
    ),
    "float ids": (
        LOOKUP,
        lambda good: request(good, ids(dtype="float32", data=bytes(4 * SMALL_ROWS))),
        "shard 0: input 'embeddings.8': ids must be a 1-D int32 or int64 tensor, got float32[3]",
    ),
    "wrong rank": (
        LOOKUP,
        lambda good: request(good, ids(shape=[SMALL_ROWS, 1])),
        "shard 0: input 'embeddings.8': ids must be a 1-D int32 or int64 tensor, got int64[3, 1]",
    ),
    "id out of range": (
        LOOKUP,
        lambda good: request(good, with_id(SMALL_ROWS)),
        "shard 0: input 'embeddings.8': id 3 is out of range; valid ids are [0, 3)",
    ),
    "id below -1": (
        LOOKUP,
        lambda good: request(good, with_id(-5)),
        "shard 0: input 'embeddings.8': id -5 is out of range; valid ids are [0, 3)",
    ),
    "int32 id below -1": (
        LOOKUP,
        lambda good: request(good, with_id(-2, torch.int32)),
        "shard 0: input 'embeddings.8': id -2 is out of range; valid ids are [0, 3)",
    ),
    "id -1": (
        LOOKUP,
        lambda good: request(good, with_id(-1, torch.int32)),
        "shard 0: input 'embeddings.8': id -1 is out of range; valid ids are [0, 3)",
    ),
    "huge count": (
        LOOKUP,
        lambda good: request(good, ids(shape=[2**40], data=b"")),
        "tensor 'embeddings.8': 1099511627776 elements, at most",
    ),
    "huge empty": (
        LOOKUP,
        lambda good: request(good, ids(shape=[2**40, 0], data=b"")),
        "tensor 'embeddings.8': empty shape [1099511627776, 0] spans 1099511627776 elements",
    ),
    "overflowing empty": (
        LOOKUP,
        lambda good: request(good, ids(shape=[0, 2**62, 2**62], data=b"")),
        "empty shape [0, 4611686",
    ),
    "negative dim": (
        LOOKUP,
        lambda good: request(good, ids(shape=[-1], data=b"")),
        "tensor 'embeddings.8': negative dimension in shape [-1]",
    ),
    "too many dims": (
        LOOKUP,
        lambda good: request(good, ids(shape=[1] * 9, data=bytes(8))),
        "tensor 'embeddings.8': 9 dimensions, at most 8",
    ),
    "long empty shape": (
        LOOKUP,
        lambda good: request(good, ids(shape=[0] + [2**62] * 100_000, data=b"")),
        "100001 dimensions",
    ),
    "duplicate input": (
        LOOKUP,
        lambda good: request(good, ids(), ids()),
        "tensor 'embeddings.8' appears more than once",
    ),
    "missing input": (
        LOOKUP,
        lambda good: request({name: local for name, local in good.items() if name != SMALL}),
        "shard 0: missing input 'embeddings.8'; expected inputs: embeddings.0, ",
    ),
    "long unknown name": (LOOKUP, lambda good: request(good, ids(name="x" * 100_000)), "... (100000 characters)"),
    "many inputs": (
        LOOKUP,
        lambda good: request(good, *(ids(name=f"n{i}", data=b"", shape=[0]) for i in range(50_000))),
        "unknown input 'n2'; 49997 more unknown inputs",
    ),
    "unknown output_dtype": (
        LOOKUP,
        lambda good: request(good, output_dtype="float64"),
        "output_dtype 'float64' is not one of float32, float16, bfloat16",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_message_is_invalid_argument_and_leaves_the_shard_serving_and_untouched(tiny_shard, good_ids, case):
    method, payload, details = HOSTILE[case]

    async def body():
        before = checksum(tiny_shard)
        async with serving(tiny_shard) as server:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_call(server, method, payload(good_ids))
            response = pb.LookupResponse.FromString(await raw_call(server, LOOKUP, lookup_bytes(good_ids)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert details in info.value.details() and len(info.value.details()) <= 2048
        with torch.inference_mode():
            expected = tiny_shard.module(**good_ids)
        assert_same(wire.decode_all(response.outputs), expected)
        assert response.version == tiny_shard.version
        assert checksum(tiny_shard) == before

    asyncio.run(body())


def test_oversized_message_is_resource_exhausted_and_leaves_the_shard_serving_and_untouched(tiny_shard, good_ids):
    async def body():
        before = checksum(tiny_shard)
        big = lookup_bytes({**good_ids, SMALL: torch.zeros(2**18, dtype=torch.int32)})  # 1 MiB of ids
        async with serving(tiny_shard, max_message_bytes=512 * 1024) as server:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_call(server, LOOKUP, big)
            await raw_call(server, LOOKUP, lookup_bytes(good_ids))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert checksum(tiny_shard) == before

    asyncio.run(body())
