"""The trained `tiny` models judged through the deployed applications (the `make serve` config) over HTTP.

Diffusion: the ControlNet runs as its own deployment (ControlNet-as-a-Service); requests are sent at once so the
model replica batches them continuously; `/cfg` adds parallel CFG on a CFGWorker deployment and two base
replicas. DLRM: held-out click logs scored through the disaggregated (`/v2`) and monolithic (`/mono/v2`) apps.
"""

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from disagg.api.codec import encode_infer_request
from disagg.model import build_preset
from disagg.spec import preset_weights
from tests.helpers.images import decode_png, encode_b64
from training.click_logs import ClickLogs, roc_auc
from training.shapes import evaluation
from training.shapes.evaluation import EVALUATION_GUIDANCE, EVALUATION_STEPS
from training.tiny_dlrm import shipped_report

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BRIEFS = 8
MIN_CONTROL_IOU = 0.5
CONTROL_IOU_MARGIN = 0.25
HELDOUT_ROWS = 8192
ROWS_PER_REQUEST = 1024
FRESH_STREAM = 11  # neither the training (0) nor the validation (1) stream of the shipped DLRM weights


def _generate(http, prefix: str, briefs: list[evaluation.Brief], *, control: bool = False,
              loras: list[dict] | None = None) -> list[np.ndarray]:
    def one(seed_and_brief):
        seed, brief = seed_and_brief
        body = {"prompt": brief.prompt, "size": "64x64", "seed": seed, "num_inference_steps": EVALUATION_STEPS,
                "guidance_scale": EVALUATION_GUIDANCE, "loras": loras or []}
        if control:
            body["controlnets"] = [{"name": "edges", "image": encode_b64(brief.control)}]
        response = http.post(f"{prefix}/v1/images/generations", json=body)
        assert response.status_code == 200, response.text
        return decode_png(base64.b64decode(response.json()["data"][0]["b64_json"]))

    with ThreadPoolExecutor(len(briefs)) as pool:  # all at once: the replica batches them step by step
        return list(pool.map(one, enumerate(briefs)))


@pytest.fixture(scope="module")
def briefs() -> list[evaluation.Brief]:
    return evaluation.briefs(BRIEFS, stream=evaluation.EVALUATION_STREAM + 3)


@pytest.mark.parametrize("prefix", ["", "/cfg"])
def test_controlnet_service_makes_the_shape_follow_the_edge_map(http, briefs, prefix):
    with_control = evaluation.control_iou(_generate(http, prefix, briefs, control=True), briefs)
    assert with_control >= MIN_CONTROL_IOU
    if prefix == "":
        without = evaluation.control_iou(_generate(http, prefix, briefs), briefs)
        assert without <= with_control - CONTROL_IOU_MARGIN, (with_control, without)


def test_prompt_colour_through_http(http, briefs):
    assert evaluation.fidelity(_generate(http, "", briefs), briefs)["colour"] >= 0.75


def test_dark_lora_darkens_the_background_through_http(http):
    short = evaluation.briefs(4, short=True, stream=evaluation.EVALUATION_STREAM + 4)
    plain = evaluation.style(_generate(http, "", short))["darkness"]
    dark = evaluation.style(_generate(http, "", short, loras=[{"name": "dark", "scale": 1.0}]))["darkness"]
    assert dark >= plain + 0.5, (plain, dark)


@pytest.fixture(scope="module")
def heldout():
    seed = shipped_report("tiny")["settings"]["data_seed"]
    return ClickLogs(build_preset("tiny").spec, seed=seed, stream=FRESH_STREAM).batch(HELDOUT_ROWS)


def _score(http, prefix: str, batch) -> np.ndarray:
    scores = []
    for start in range(0, len(batch), ROWS_PER_REQUEST):
        rows = slice(start, start + ROWS_PER_REQUEST)
        body = encode_infer_request({"dense_features": batch.dense[rows],
                                     "sparse_features": batch.sparse[rows]}).model_dump()
        response = http.post(f"{prefix}/models/dlrm/infer", json=body)
        assert response.status_code == 200, response.text
        scores.append(np.asarray(response.json()["outputs"][0]["data"], dtype=np.float64))
    return np.concatenate(scores)


def test_dlrm_auc_over_http_on_both_paths(http, heldout):
    """Held-out click logs scored over HTTP by the disaggregated and the monolithic app: the same scores as the
    shipped model in process, and an AUC of at least 0.75 (the generator's best achievable beside it)."""
    model = build_preset("tiny", weights=preset_weights("tiny")).eval()
    with torch.inference_mode():
        expected = model(heldout.dense, heldout.sparse).numpy().ravel()
    aucs = {}
    for prefix in ("/v2", "/mono/v2"):
        served = _score(http, prefix, heldout)
        np.testing.assert_allclose(served, expected, rtol=0, atol=1e-6)
        aucs[prefix] = roc_auc(served, heldout.labels)
    best = roc_auc(heldout.probability, heldout.labels)
    assert aucs["/v2"] == aucs["/mono/v2"] >= 0.75, (aucs, best)
    assert best > aucs["/v2"]  # the generator's own Bayes-optimal scores bound the model's
