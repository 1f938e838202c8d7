"""The official Triton HTTP client against the OIP API served by uvicorn on loopback (fake backend, no Ray).

tritonclient sends inputs and asks for outputs as binary tensor data by default, so this exercises the
binary extension end to end, besides JSON mode, errors and a server mounted under a base path.
"""

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from disagg.api.server import create_oip_api
from tests.helpers.oip_fakes import MAX_IDS, FakeBackend, app_config, expected_scores

PREFIX = "/some/prefix"


class RoutePrefixes:
    """Routes like Ray Serve's proxy: the longest matching route prefix wins and becomes the ``root_path``;
    the path stays whole (so ``/v2`` itself reaches the app, unlike under a Starlette ``Mount``)."""

    def __init__(self, apps: dict[str, ASGIApp]) -> None:
        self.apps = dict(sorted(apps.items(), key=lambda item: -len(item[0])))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        for prefix, app in self.apps.items():
            if scope["path"] == prefix or scope["path"].startswith(prefix + "/"):
                await app(dict(scope, root_path=scope.get("root_path", "") + prefix), receive, send)
                return
        raise AssertionError(f"no route for {scope['path']}")


class Served:
    """The app behind uvicorn on a free loopback port, at ``/v2`` and at ``{PREFIX}/v2``."""

    def __init__(self) -> None:
        self.backend = FakeBackend()
        api = create_oip_api(self.backend, app_config())
        root = RoutePrefixes({"/v2": api, f"{PREFIX}/v2": api})
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(root, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> "Served":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with Served() as served:
        yield served


@pytest.fixture(params=["", PREFIX], ids=["root", "base path"])
def client(served: Served, request: pytest.FixtureRequest) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(served.address + request.param)
    yield client
    client.close()


def make_inputs(rows: int, ids: int | None, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Dense FP32 rows and INT64 ids < 3 (valid in every table): [rows, 26] or [rows, 26, ids] with -1 holes."""
    generator = np.random.default_rng(seed)
    dense = generator.standard_normal((rows, 13), dtype=np.float32)
    shape = (rows, 26) if ids is None else (rows, 26, ids)
    return dense, generator.integers(-1 if ids else 0, 3, shape, dtype=np.int64)


def triton_inputs(
    dense: np.ndarray, sparse: np.ndarray, *, binary_data: bool = True, dense_name: str = "dense_features"
) -> list[httpclient.InferInput]:
    tensors = []
    for name, array in ((dense_name, dense), ("sparse_features", sparse)):
        tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensors.append(tensor.set_data_from_numpy(array, binary_data=binary_data))
    return tensors


def test_health_and_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("ctr") and client.is_model_ready("ctr", "1")
    assert not client.is_model_ready("other")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    metadata = client.get_model_metadata("ctr")
    assert {tensor["name"]: tensor["shape"] for tensor in metadata["inputs"]} == {
        "dense_features": [-1, 13], "sparse_features": [-1, 26, -1]
    }  # fmt: skip


@pytest.mark.parametrize("ids", [None, 1, MAX_IDS], ids=["one-hot [B, T]", "[B, T, 1]", "multi-hot"])
def test_binary_infer(client: httpclient.InferenceServerClient, served: Served, ids: int | None) -> None:
    dense, sparse = make_inputs(rows=6, ids=ids)
    result = client.infer("ctr", triton_inputs(dense, sparse), request_id="t-1")
    [output] = result.get_response()["outputs"]
    assert output["parameters"] == {"binary_data_size": 6 * 4}  # the output came back as binary data
    assert result.get_response()["id"] == "t-1"
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected_scores(dense, sparse), rtol=1e-6)
    assert np.array_equal(served.backend.calls[-1]["sparse"].numpy(), sparse.reshape(6, 26, -1))


def test_json_infer(client: httpclient.InferenceServerClient) -> None:
    dense, sparse = make_inputs(rows=3, ids=3, seed=1)
    outputs = [httpclient.InferRequestedOutput("probabilities", binary_data=False)]
    result = client.infer("ctr", triton_inputs(dense, sparse, binary_data=False), model_version="1", outputs=outputs)
    [output] = result.get_response()["outputs"]
    assert "parameters" not in output and len(output["data"]) == 3
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected_scores(dense, sparse), rtol=1e-6)


def bad_name(dense, sparse):
    return triton_inputs(dense, sparse, dense_name="age")


def bad_datatype(dense, sparse):
    return triton_inputs(dense.astype(np.float64), sparse)


def nan_dense(dense, sparse):
    dense[1, 2] = np.nan
    return triton_inputs(dense, sparse)


def bad_id(dense, sparse):
    sparse[0, 4, 1] = 5000
    return triton_inputs(dense, sparse)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (bad_name, "inputs[0].name: unknown input 'age'"),
        (bad_datatype, "inputs[0].datatype: dense_features must be FP32, got FP64"),
        (nan_dense, "inputs[0].data: dense_features value nan at row 1, position 2"),
        (bad_id, "inputs[1].data: id 5000 in row 0, position [4, 1] is out of range for table embeddings.4"),
    ],
    ids=["input name", "datatype", "nan", "id"],
)
def test_errors_surface_as_400_naming_the_field(
    client: httpclient.InferenceServerClient, served: Served, make, message: str
) -> None:
    calls = len(served.backend.calls)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("ctr", make(*make_inputs(rows=2, ids=2)))
    assert raised.value.status() == "400"
    assert raised.value.message().startswith(message), raised.value.message()
    assert len(served.backend.calls) == calls
