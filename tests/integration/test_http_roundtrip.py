"""Real HTTP against both Serve applications of the default config."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from tests.helpers.images import encode_b64, square

pytestmark = pytest.mark.integration

TINY_DLRM_TABLES = 26


def _dlrm_request(rows: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "id": "req-1",
        "inputs": [
            {"name": "dense_features", "shape": [rows, 13], "datatype": "FP32",
             "data": rng.random((rows, 13)).astype(np.float32).ravel().tolist()},
            {"name": "sparse_features", "shape": [rows, TINY_DLRM_TABLES], "datatype": "INT64",
             "data": rng.integers(0, 3, size=(rows, TINY_DLRM_TABLES)).ravel().tolist()},
        ],
    }


def test_image_generation_returns_png_of_requested_size(http):
    response = http.post("/v1/images/generations",
                         json={"prompt": "a red circle", "size": "48x32", "n": 2, "num_inference_steps": 2})
    assert response.status_code == 200, response.text
    images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in response.json()["data"]]
    assert [(image.format, image.size) for image in images] == [("PNG", (48, 32))] * 2


def test_lora_generation_through_the_model_deployment(http):
    body = {"prompt": "a red circle", "seed": 2, "num_inference_steps": 2,
            "loras": [{"name": "outlined", "scale": 0.8}]}
    response = http.post("/v1/images/generations", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["lora"]["names"] == ["outlined"]
    assert http.post("/v1/images/generations", json=body).json()["lora"]["cache_hits"] == 1


@pytest.mark.parametrize(
    ("name", "status"), [("missing", 404), ("../outlined", 400), ("corrupt", 422)],
)
def test_lora_errors_cross_the_replica_boundary_intact(http, name, status):
    body = {"prompt": "x", "num_inference_steps": 2, "loras": [{"name": name}]}
    response = http.post("/v1/images/generations", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == "loras[0].name"


def test_models_and_health(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [  # base models, then each one's add-ons
        "tiny", "sdxl-tiny", "flux-tiny", "edges", "dark", "outlined", "edges-xl"]  # not `corrupt`: unreadable
    assert http.get("/health").json() == {"status": "ok"}
    assert "/v1/images/generations" in http.get("/openapi.json").json()["paths"]


def test_the_sdxl_and_flux_models_served_beside_tiny_answer_requests_that_name_them(http):
    """`make serve` serves `tiny` (SD, the default), `sdxl-tiny` (SDXL) and `flux-tiny` (Flux.1): a request's `model`
    picks one; tiny and sdxl-tiny each with its own ControlNet service; Flux takes `true_cfg_scale`."""
    bases = {card["id"]: card for card in http.get("/v1/models").json()["data"] if card["kind"] == "base-model"}
    assert {name: (card["family"], card["size"]) for name, card in bases.items()} == {
        "tiny": ("sd", "64x64"), "sdxl-tiny": ("sdxl", "64x64"), "flux-tiny": ("flux", "64x64")}
    body = {"prompt": "a red circle", "num_inference_steps": 2, "seed": 4}  # no size: the model's native one
    flux = {"negative_prompt": "blue", "true_cfg_scale": 2.0}
    images = {}
    for model in ("sdxl-tiny", "tiny", "flux-tiny"):
        response = http.post("/v1/images/generations", json=body | {"model": model} | (flux if "flux" in model else {}))
        assert response.status_code == 200, response.text
        images[model] = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
    for model in ("sdxl-tiny", "flux-tiny"):
        assert (images[model].format, images[model].size) == ("PNG", (64, 64))
        assert np.asarray(images[model]).tobytes() != np.asarray(images["tiny"]).tobytes()  # another model drew it
    response = http.post("/v1/images/generations", json=body | flux)  # tiny runs CFG at guidance_scale
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "true_cfg_scale"

    control = {"controlnets": [{"name": "edges-xl", "image": encode_b64(square())}]}
    response = http.post("/v1/images/generations", json=body | control | {"model": "sdxl-tiny"})
    assert response.status_code == 200, response.text
    response = http.post("/v1/images/generations", json=body | control)  # no model: tiny, which lacks edges-xl
    assert response.status_code == 422, response.text
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (
        "model_mismatch", "controlnets[0].name")


def test_dlrm_returns_one_probability_per_row(http):
    assert http.get("/v2/health/ready").status_code == 200
    assert http.get("/v2/models/dlrm").json()["name"] == "dlrm"
    response = http.post("/v2/models/dlrm/infer", json=_dlrm_request(rows=5))
    assert response.status_code == 200, response.text
    (output,) = response.json()["outputs"]
    assert output["shape"] == [5, 1] and output["datatype"] == "FP32"
    assert all(0.0 <= p <= 1.0 for p in output["data"]) and len(output["data"]) == 5


def test_dlrm_concurrent_requests_each_get_their_rows(http):
    import concurrent.futures

    requests = [_dlrm_request(rows=r, seed=r) for r in (1, 3, 7, 2)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(lambda body: http.post("/v2/models/dlrm/infer", json=body).json(), requests))
    alone = [http.post("/v2/models/dlrm/infer", json=body).json() for body in requests]
    for together, single, body in zip(batched, alone, requests, strict=True):
        rows = body["inputs"][0]["shape"][0]
        assert together["outputs"][0]["shape"] == [rows, 1]
        np.testing.assert_allclose(together["outputs"][0]["data"], single["outputs"][0]["data"], rtol=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/images/generations", b'{"prompt": ', "body"),
        ("/v1/images/generations", b'{"n": 1}', "prompt"),
        ("/v1/images/generations", b'{"prompt": "x", "n": "two"}', "n"),
        ("/v2/models/dlrm/infer", b'{"inputs": [', "body"),
        ("/v2/models/dlrm/infer", b'{"id": "x"}', "inputs"),
        ("/v2/models/dlrm/infer", b'{"inputs": [{"name": "dense_features", "shape": "5x13", '
                                  b'"datatype": "FP32", "data": []}]}', "inputs[0].shape"),
    ],
)
def test_bad_requests_get_4xx_naming_the_field(http, path, body, field):
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert field in message
    if isinstance(error, dict):
        assert error["param"] == field


def test_controlnet_service_gives_the_in_process_image(http):
    """The remote ControlNet deployment (object store, @serve.batch) matches an in-process ControlNet."""
    import torch

    from serving.controlnet.client import LocalControlNets
    from serving.controlnet.models import build_controlnet_preset
    from serving.controlnet.runner import ControlNetRunner
    from serving.engine import DiffusionEngine, GenerationParams
    from serving.engine.types import ControlNetSpec
    from serving.presets import build_preset

    square = np.zeros((64, 64, 3), np.uint8)
    square[16:48, 20:44] = 255
    buffer = io.BytesIO()
    Image.fromarray(square).save(buffer, format="PNG")
    body = {"prompt": "a red square", "seed": 11, "num_inference_steps": 3, "size": "64x64",
            "controlnets": [{"name": "edges", "image": base64.b64encode(buffer.getvalue()).decode(),
                             "conditioning_scale": 1.2}]}
    response = http.post("/v1/images/generations", json=body)
    assert response.status_code == 200, response.text
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))))

    cpu = torch.device("cpu")
    local = DiffusionEngine("tiny", build_preset("tiny", weights="auto"), cpu, controlnets=LocalControlNets(
        {"edges": ControlNetRunner(build_controlnet_preset("tiny", weights="auto"), cpu)}))
    state = local.start(GenerationParams("a red square", 64, 64, 3, 7.5, 11,
                                         controlnets=(ControlNetSpec("edges", square, 1.2),)))
    while not state.done:
        local.step([state])
    expected = (local.decode(state)[0] * 255).round()
    assert np.abs(served.astype(float) - expected).max() <= 1


def test_parallel_cfg_app_gives_the_same_image(http):
    """`engine.cfg_parallel`: unconditional rows on the CFGWorker deployment, same image as without (`exact`
    LoRA mode: the LoRA applies from the first step whether or not the answering replica had it cached)."""
    body = {"prompt": "a blue disk", "seed": 5, "num_inference_steps": 3, "size": "64x64", "guidance_scale": 6.0,
            "negative_prompt": "red", "loras": [{"name": "outlined", "scale": 0.7}], "lora_mode": "exact"}
    images = []
    for prefix in ("", "/cfg"):
        response = http.post(f"{prefix}/v1/images/generations", json=body)
        assert response.status_code == 200, response.text
        assert (response.json()["lora"]["mode"], response.json()["lora"]["applied_at_step"]) == ("exact", 0)
        png = base64.b64decode(response.json()["data"][0]["b64_json"])
        images.append(np.asarray(Image.open(io.BytesIO(png))).astype(int))
    assert np.abs(images[0] - images[1]).max() <= 1
