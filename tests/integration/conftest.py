"""One Ray cluster per test session, with both applications of deploy/serve_config.yaml deployed.

The config is the one `make serve` uses, deployed through the same Serve controller path as
`serve run`; only the HTTP port is swapped for a free one.
"""

import copy
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve
from ray.serve.schema import ServeDeploySchema

from serving.common.serve_config import deploy_serve_config, load_serve_config
from tests.lora_files import write_lora

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def lora_dir(tmp_path_factory) -> Path:
    """The diffusion app's LoRA directory: one real LoRA and one corrupt file."""
    directory = tmp_path_factory.mktemp("serve-loras")
    write_lora(directory / "outlined.safetensors", seed=1, text_encoder=True)
    (directory / "corrupt.safetensors").write_bytes(b"not a safetensors file")
    return directory


@pytest.fixture(scope="session")
def base_url(lora_dir: Path) -> Iterator[str]:
    config = load_serve_config(REPO / "deploy" / "serve_config.yaml")
    config.http_options.host = "127.0.0.1"
    config.http_options.port = _free_port()
    diffusion = next(app for app in config.applications if app.name == "diffusion")
    diffusion.args.setdefault("lora", {})["directory"] = str(lora_dir)
    diffusion.args.setdefault("engine", {})["remote_timeout_s"] = 10.0  # fault tests wait less
    config = _with_parallel_cfg_variant(config)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}})
    try:
        deploy_serve_config(config, timeout_s=600)
        yield f"http://127.0.0.1:{config.http_options.port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _with_parallel_cfg_variant(config: ServeDeploySchema) -> ServeDeploySchema:
    """Adds `diffusion-cfg` at /cfg: the diffusion app with `engine.cfg_parallel` (a CFGWorker deployment)
    and its own ControlNet deployment, each given a sliver of CPU so the 2-CPU cluster can place them."""
    raw = config.model_dump(exclude_unset=True)
    diffusion = next(app for app in raw["applications"] if app["name"] == "diffusion")
    variant = copy.deepcopy(diffusion)
    variant.update(name="diffusion-cfg", route_prefix="/cfg")
    variant["args"].setdefault("engine", {})["cfg_parallel"] = True
    variant["deployments"] = [
        {"name": name, "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.05}}
        for name in ("ImagesIngress", "DiffusionModel", "CFGWorker", "ControlNet_edges")
    ]
    raw["applications"].append(variant)
    return ServeDeploySchema.model_validate(raw)


@pytest.fixture(scope="session")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client
