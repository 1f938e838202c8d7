"""`dlrm-secure`: the DLRM app with its embedding shards bound to every interface behind mutual TLS and a shared
token, both from the Serve config (TLS files in `args.embedding`, the token in the app's `runtime_env`). The
settings reach the shard and dense replicas: the app serves, and its shards refuse anything short of both."""

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from httpx import Client
from ray import serve
from ray.cluster_utils import Cluster

from disagg.api.codec import encode_infer_request
from disagg.rpc._proto import embedding_pb2 as pb
from disagg.rpc.client import ShardClient, ShardUnavailable
from disagg.spec import preset_spec
from disagg.synthetic import SyntheticRequests
from tests.helpers.pki import PKI, SERVER_NAME, trusting
from tests.integration.conftest import SECURE_TOKEN

pytestmark = pytest.mark.integration

APP = "dlrm-secure"


def _probabilities(http: Client, prefix: str, dense: torch.Tensor, sparse: torch.Tensor) -> np.ndarray:
    body = encode_infer_request({"dense_features": dense, "sparse_features": sparse})
    response = http.post(f"{prefix}/models/dlrm/infer", json=body.model_dump())
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["outputs"][0]["data"], dtype=np.float32)


@pytest.fixture(scope="module")
def shard_address(base_url: str) -> str:
    """Where shard 0 of `dlrm-secure` serves, as its replica announced it (its node's IP: it binds 0.0.0.0)."""
    addresses = serve.get_deployment_handle("ShardDirectory", APP).addresses.remote().result(timeout_s=60)
    assert len(addresses[0]) == 1, addresses  # one replica per shard
    return addresses[0][0]


def _info(address: str, **client_options) -> pb.ShardInfo:
    """The shard's Info through a ShardClient from this process; ShardUnavailable when the replica refused it."""

    async def call() -> pb.ShardInfo:
        client = ShardClient(0, [address], **client_options)
        try:
            return await client.info(timeout_s=10)
        finally:
            await client.close()

    return asyncio.run(call())


def _refusal(address: str, **client_options) -> str:
    """Why the shard refused Info to a client with ``client_options``: ``ShardUnavailable.last_error``."""
    with pytest.raises(ShardUnavailable) as info:
        _info(address, **client_options)
    return info.value.last_error


def test_secured_shards_serve_the_same_outputs_as_the_plain_app(http: Client):
    dense, sparse = SyntheticRequests(preset_spec("tiny"), seed=11, max_hotness=3).batch(16)
    secured = _probabilities(http, "/secure/v2", dense, sparse)
    np.testing.assert_allclose(secured, _probabilities(http, "/v2", dense, sparse), rtol=0, atol=1e-6)


def test_a_secured_shard_answers_only_mutual_tls_with_the_token(embedding_pki: PKI, shard_address: str):
    pki = embedding_pki
    certified = trusting(pki.ca, pki.named_cert, pki.named_key)  # what the app's dense replicas present
    plaintext = _refusal(shard_address, token=SECURE_TOKEN)
    untokened = _refusal(shard_address, credentials=certified, server_name=SERVER_NAME)
    anonymous = _refusal(shard_address, credentials=trusting(pki.ca), server_name=SERVER_NAME, token=SECURE_TOKEN)
    info = _info(shard_address, credentials=certified, server_name=SERVER_NAME, token=SECURE_TOKEN)
    # No TLS, or TLS without a client certificate: the handshake fails, so the token is never even checked.
    for refusal in (plaintext, anonymous):
        assert "UNAVAILABLE" in refusal and "UNAUTHENTICATED" not in refusal, refusal
    assert "UNAUTHENTICATED: missing token" in untokened, untokened
    assert (info.model, info.shard_index, info.num_shards) == ("tiny", 0, 2)


def _serve_and_worker_logs(logs: Path) -> str:
    """Serve's log files (controller, proxies, replicas) and every worker's stdout and stderr, as one text."""
    files = [*logs.glob("serve/**/*"), *logs.glob("worker-*")]
    return "\n".join(path.read_bytes().decode(errors="replace") for path in files if path.is_file())


def test_the_token_never_reaches_the_logs(http: Client, cluster: Cluster, embedding_pki: PKI, shard_address: str):
    """After lookups, refusals and a presented token extending the real one (a logged token would show it),
    the token is in none of the logs the app's code writes to. Not scanned: Ray's own runtime-env agent log,
    which records each runtime_env verbatim (why docs/DEPLOYMENT.md keeps the token out of runtime_env)."""
    _probabilities(http, "/secure/v2", *SyntheticRequests(preset_spec("tiny"), seed=12).batch(4))
    pki = embedding_pki
    certified = trusting(pki.ca, pki.named_cert, pki.named_key)
    near_miss = _refusal(shard_address, credentials=certified, server_name=SERVER_NAME, token=f"{SECURE_TOKEN}x")
    assert "UNAUTHENTICATED: invalid token" in near_miss and SECURE_TOKEN not in near_miss
    logs = Path(cluster.head_node.get_logs_dir_path())
    deadline = time.monotonic() + 30
    while ": wrong token" not in (text := _serve_and_worker_logs(logs)):  # the refusal is logged, so scanned
        assert time.monotonic() < deadline, f"the shard's refusal is not in the logs under {logs}"
        time.sleep(0.5)
    assert SECURE_TOKEN not in text
