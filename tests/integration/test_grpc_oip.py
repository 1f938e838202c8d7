"""OIP v2 over gRPC through Serve's gRPC proxy (`grpc_options` of deploy/serve_config.yaml): `tritonclient.grpc`
unchanged against the DLRM app in both layouts, outputs equal to the REST binary path's, refusals with REST's
messages, and a call that names no application refused by Serve (two apps run)."""

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from disagg.model import build_preset
from disagg.spec import preset_weights
from disagg.synthetic import SyntheticRequests

pytestmark = pytest.mark.integration

#: layout -> (Serve application, REST route prefix before /v2)
APPS = {"disaggregated": ("dlrm", ""), "monolithic": ("dlrm-mono", "/mono")}


@pytest.fixture(scope="module")
def spec():
    return build_preset("tiny", weights=preset_weights("tiny")).spec


@pytest.fixture
def grpc_client(base_url, grpc_port):
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    yield client
    client.close()


def _inputs(module, dense: np.ndarray, sparse: np.ndarray, **binary) -> list:
    inputs = [module.InferInput("dense_features", list(dense.shape), "FP32"),
              module.InferInput("sparse_features", list(sparse.shape), "INT64")]
    inputs[0].set_data_from_numpy(dense, **binary)
    inputs[1].set_data_from_numpy(sparse, **binary)
    return inputs


@pytest.mark.parametrize("layout", list(APPS))
def test_tritonclient_grpc_answers_as_the_rest_binary_path(base_url, grpc_client, spec, layout):
    app, prefix = APPS[layout]
    headers = {"application": app}
    assert grpc_client.is_server_live(headers=headers) and grpc_client.is_server_ready(headers=headers)
    assert grpc_client.is_model_ready("dlrm", headers=headers)
    metadata = grpc_client.get_model_metadata("dlrm", headers=headers)
    assert [(t.name, t.datatype) for t in metadata.inputs] == [("dense_features", "FP32"), ("sparse_features", "INT64")]
    dense, sparse = (tensor.numpy() for tensor in SyntheticRequests(spec, seed=11, max_hotness=3).batch(16))

    over_grpc = grpc_client.infer("dlrm", _inputs(triton_grpc, dense, sparse), headers=headers)
    rest = triton_http.InferenceServerClient(base_url.removeprefix("http://") + prefix)
    over_rest = rest.infer("dlrm", _inputs(triton_http, dense, sparse, binary_data=True),
                           outputs=[triton_http.InferRequestedOutput("probabilities", binary_data=True)])
    probabilities = over_grpc.as_numpy("probabilities")
    assert probabilities.shape == (16, 1) and np.array_equal(probabilities, over_rest.as_numpy("probabilities"))

    sparse[3, 0] = spec.table_sizes[0]  # one past table 0's last id
    with pytest.raises(InferenceServerException) as refused_grpc:
        grpc_client.infer("dlrm", _inputs(triton_grpc, dense, sparse), headers=headers)
    with pytest.raises(InferenceServerException) as refused_rest:
        rest.infer("dlrm", _inputs(triton_http, dense, sparse, binary_data=True))
    assert refused_grpc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert refused_grpc.value.message() == refused_rest.value.message()
    assert "out of range for table embeddings.0" in refused_grpc.value.message()
    rest.close()


def test_an_unknown_model_is_not_found_and_a_call_naming_no_application_is_refused(base_url, grpc_client):
    with pytest.raises(InferenceServerException) as unknown:
        grpc_client.get_model_metadata("ctr", headers={"application": "dlrm"})
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    assert unknown.value.message() == "model 'ctr' not found; this server serves 'dlrm'"
    with pytest.raises(InferenceServerException) as unrouted:
        grpc_client.is_server_live()
    assert unrouted.value.status() == "StatusCode.NOT_FOUND"
    assert "Application metadata not set" in unrouted.value.message()
