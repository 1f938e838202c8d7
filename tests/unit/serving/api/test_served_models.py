"""One Images API serving two base models of different families (``tiny``: SD, ``sdxl-tiny``: SDXL), each with its
own engine, ControlNets, LoRAs and limits; a request's ``model`` picks one (no Ray)."""

import base64
import io

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from serving.api.models import ServedModel, ServedModels
from serving.config import DiffusionAppConfig, DiffusionModelConfig, GenerationDefaults, ImagesAppConfig, LoRAConfig
from serving.engine import DiffusionEngine, GenerationParams, LocalBackend
from tests.helpers.denoising import denoise_together
from tests.helpers.images import encode_b64, square
from tests.helpers.images_api import models_client
from tests.helpers.lora_files import write_lora

SDXL = DiffusionModelConfig(name="sdxl-tiny", preset="sdxl-tiny", weights="seeded", device="cpu")


@pytest.fixture(scope="module")
def sdxl_engine() -> DiffusionEngine:
    return DiffusionEngine.from_config(SDXL)


@pytest.fixture(scope="module")
def client(tiny_engine, sdxl_engine, tmp_path_factory):
    directory = tmp_path_factory.mktemp("sd-loras")
    write_lora(directory / "outlined.safetensors", seed=1)
    tiny = DiffusionAppConfig(defaults=GenerationDefaults(num_inference_steps=2), lora=LoRAConfig(directory=directory))
    sdxl = DiffusionAppConfig(model=SDXL, defaults=GenerationDefaults(num_inference_steps=2, guidance_scale=5.0))
    with models_client([(tiny_engine, tiny), (sdxl_engine, sdxl)]) as test_client:
        yield test_client


def _image(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))))


def test_the_request_model_picks_the_engine_and_its_defaults(client, tiny_engine, sdxl_engine):
    body = {"prompt": "a red circle", "seed": 3, "size": "48x64"}
    for name, engine, guidance in (("tiny", tiny_engine, 7.5), ("sdxl-tiny", sdxl_engine, 5.0)):
        params = GenerationParams("a red circle", 48, 64, 2, guidance, 3)
        expected = (denoise_together(engine, [(params, [])])[0][0] * 255).round()
        assert np.abs(_image(client.post("/v1/images/generations", json={**body, "model": name})) - expected).max() \
            <= 1
    default = _image(client.post("/v1/images/generations", json=body))
    np.testing.assert_array_equal(default, _image(client.post("/v1/images/generations", json={**body,
                                                                                               "model": "tiny"})))


def test_models_lists_each_base_model_with_its_family_and_size_then_what_each_serves(client):
    cards = [{key: card.get(key) for key in ("id", "kind", "family", "size", "model")}
             for card in client.get("/v1/models").json()["data"]]
    assert cards == [
        {"id": "tiny", "kind": "base-model", "family": "sd", "size": "64x64", "model": None},
        {"id": "sdxl-tiny", "kind": "base-model", "family": "sdxl", "size": "64x64", "model": None},
        {"id": "edges", "kind": "controlnet", "family": None, "size": None, "model": "tiny"},
        {"id": "outlined", "kind": "lora", "family": None, "size": None, "model": "tiny"},
    ]


def test_a_model_not_served_is_404_listing_the_served_ones(client):
    response = client.post("/v1/images/generations", json={"prompt": "x", "model": "flux"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert error["message"] == "model 'flux' does not exist; served models: 'tiny', 'sdxl-tiny'"


@pytest.mark.parametrize(("item", "param", "kind"), [
    ({"loras": [{"name": "outlined"}]}, "loras[0].name", "LoRA"),
    ({"controlnets": [{"name": "edges", "image": encode_b64(square())}]}, "controlnets[0].name", "ControlNet"),
])
def test_an_item_served_with_a_model_of_another_family_is_422_naming_it(client, item, param, kind):
    response = client.post("/v1/images/generations", json={"prompt": "x", "model": "sdxl-tiny", **item})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "model_mismatch")
    name = param.split("[")[0]
    assert error["message"] == (f"{kind} {item[name][0]['name']!r} is served with model 'tiny' and needs the sd "
                                "family; model 'sdxl-tiny' is sdxl")


def test_an_item_no_model_serves_stays_a_404(client):
    response = client.post("/v1/images/generations", json={"prompt": "x", "model": "sdxl-tiny",
                                                           "loras": [{"name": "nowhere"}]})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "lora_not_found"


def test_model_names_must_be_distinct(tiny_engine):
    tiny = DiffusionAppConfig()
    with pytest.raises(ValidationError, match=r"each model\.name must be unique; repeated: tiny"):
        ImagesAppConfig(models=[tiny, tiny])
    backend = LocalBackend.for_engine(tiny_engine, tiny)
    try:
        with pytest.raises(ValueError, match="distinct names"):
            ServedModels([ServedModel(backend, tiny), ServedModel(backend, tiny)])
    finally:
        backend.close()


def test_a_lora_directory_shared_by_three_families_lists_each_lora_with_the_models_it_is_for(tiny_engine, sdxl_engine,
                                                                                               tmp_path):
    """Read from the files' headers: transformer keys are SD3's, a second text encoder's keys SDXL's, and an SD LoRA's
    UNet modules are not the SDXL model's; a file whose header cannot be read is not listed."""
    for name, preset in (("sd-style", "tiny"), ("xl-style", "sdxl-tiny"), ("sd3-style", "sd3-tiny")):
        write_lora(tmp_path / f"{name}.safetensors", seed=1, text_encoder=True, preset=preset)
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    sd3 = DiffusionModelConfig(name="sd3-tiny", preset="sd3-tiny", device="cpu")
    shared = LoRAConfig(directory=tmp_path)
    models = [(tiny_engine, DiffusionAppConfig(lora=shared)),
              (sdxl_engine, DiffusionAppConfig(model=SDXL, lora=shared)),
              (DiffusionEngine.from_config(sd3), DiffusionAppConfig(model=sd3, lora=shared))]
    with models_client(models) as client:
        cards = client.get("/v1/models").json()["data"]
    listed = {(card["id"], card["model"]) for card in cards if card["kind"] == "lora"}
    assert listed == {("sd-style", "tiny"), ("xl-style", "sdxl-tiny"), ("sd3-style", "sd3-tiny")}
