"""Disaggregated DLRM on a multi-node cluster: placement by resources, equality with the monolithic path
and the model, tritonclient, replica failover and shard outage."""

import threading

import numpy as np
import pytest
import torch
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from disagg.api.codec import encode_infer_request
from disagg.model import build_preset
from disagg.spec import preset_weights
from disagg.synthetic import SyntheticRequests
from tests.helpers.replicas import answers_from_replicas, kill_replica, named_replicas, running_replicas
from tests.helpers.waiting import first_answer, wait_for
from tests.integration.conftest import POOLS

POLL = {"timeout_s": 60.0, "period_s": 0.2}
RECOVERY = {"timeout_s": 180.0, "period_s": 1.0}  # Serve replacing a killed replica

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model():
    return build_preset("tiny", weights=preset_weights("tiny")).eval()  # what both DLRM apps serve


def _infer(http, prefix: str, dense: torch.Tensor, sparse: torch.Tensor):
    body = encode_infer_request({"dense_features": dense, "sparse_features": sparse})
    return http.post(f"{prefix}/models/dlrm/infer", json=body.model_dump())


def _probabilities(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["outputs"][0]["data"], dtype=np.float32)


def test_shards_and_dense_replicas_are_placed_by_their_pool_resources(http, pool_nodes):
    for shard in ("EmbeddingShard_0", "EmbeddingShard_1"):
        assert set(answers_from_replicas("dlrm", shard, "node_id", 1)) == {pool_nodes[POOLS["embedding"]]}
        assert len(answers_from_replicas("dlrm", shard, "address", 2)) == 2  # two replicas per shard
    assert set(answers_from_replicas("dlrm", "DisaggregatedDLRM", "node_id", 1)) == {pool_nodes[POOLS["dense"]]}


@pytest.mark.parametrize("hotness", [1, 4])
def test_disaggregated_equals_monolithic_and_the_model(http, model, hotness):
    requests = SyntheticRequests(model.spec, seed=hotness, max_hotness=hotness)
    for rows in (1, 7, 64):
        dense, sparse = requests.batch(rows)
        disaggregated = _probabilities(_infer(http, "/v2", dense, sparse))
        monolithic = _probabilities(_infer(http, "/mono/v2", dense, sparse))
        with torch.inference_mode():
            expected = model(dense, sparse).numpy().ravel()
        np.testing.assert_allclose(disaggregated, monolithic, rtol=0, atol=1e-6)
        np.testing.assert_allclose(disaggregated, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("prefix", ["", "/mono"], ids=["disaggregated", "monolithic"])
def test_tritonclient_with_binary_tensors_through_serve(base_url, model, prefix):
    client = triton.InferenceServerClient(base_url.removeprefix("http://") + prefix)
    assert client.is_server_ready() and client.is_model_ready("dlrm")
    metadata = client.get_model_metadata("dlrm")
    assert [tensor["name"] for tensor in metadata["inputs"]] == ["dense_features", "sparse_features"]
    dense, sparse = SyntheticRequests(model.spec, seed=9, max_hotness=3).batch(16)
    inputs = [triton.InferInput("dense_features", list(dense.shape), "FP32"),
              triton.InferInput("sparse_features", list(sparse.shape), "INT64")]
    inputs[0].set_data_from_numpy(dense.numpy())
    inputs[1].set_data_from_numpy(sparse.numpy())
    result = client.infer("dlrm", inputs, outputs=[triton.InferRequestedOutput("probabilities")])
    with torch.inference_mode():
        np.testing.assert_allclose(result.as_numpy("probabilities"), model(dense, sparse).numpy(), atol=1e-6)
    inputs[1] = triton.InferInput("sparse_features", list(sparse.shape), "FP64")
    inputs[1].set_data_from_numpy(sparse.numpy().astype(np.float64))
    with pytest.raises(InferenceServerException, match=r"inputs\[1\]\.datatype"):
        client.infer("dlrm", inputs)
    client.close()


def test_killing_one_replica_of_a_shard_loses_no_request(http, model):
    dense, sparse = SyntheticRequests(model.spec, seed=3).batch(4)
    statuses: list[int] = []
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            statuses.append(_infer(http, "/v2", dense, sparse).status_code)

    replicas = named_replicas("dlrm", "EmbeddingShard_0")
    assert len(replicas) == 2
    thread = threading.Thread(target=stream)
    thread.start()
    try:
        wait_for(lambda: statuses, "no request was answered", **POLL)
        kill_replica(replicas[0])
        # requests keep flowing while the dead replica is noticed and replaced, until its replacement runs
        wait_for(lambda: len({replica["name"] for replica in running_replicas("dlrm", "EmbeddingShard_0")}
                             - {replica["name"] for replica in replicas}) == 1,
                 "no replacement replica of shard 0 is running", **RECOVERY)
        answered = len(statuses)
        wait_for(lambda: len(statuses) > answered, "no request was answered after the replacement", **POLL)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert set(statuses) == {200}, statuses


def test_shard_outage_gives_503_then_recovers(http, model):
    """With every replica of shard 1 dead, a request is answered 503 naming the shard (the lookup's deadline, not a
    hang: the HTTP client's own timeout would fail the test); Serve's replacements then answer it exactly."""
    dense, sparse = SyntheticRequests(model.spec, seed=4).batch(4)
    _probabilities(_infer(http, "/v2", dense, sparse))
    for replica in named_replicas("dlrm", "EmbeddingShard_1"):
        kill_replica(replica)
    response = _infer(http, "/v2", dense, sparse)
    assert response.status_code == 503, response.text
    assert response.headers.get("retry-after") == "1"
    assert "embedding shard 1" in response.json()["error"]

    # Serve replaces the replicas; 503s until then
    response = first_answer(lambda: _infer(http, "/v2", dense, sparse), "shard 1 did not recover", **RECOVERY)
    with torch.inference_mode():
        np.testing.assert_allclose(_probabilities(response), model(dense, sparse).numpy().ravel(), atol=1e-6)
