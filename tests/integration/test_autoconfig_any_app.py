"""`autoconfig tune` on an application of the user's own: a Serve app this process cannot import, shipped to its
replicas by a ``local://`` working_dir, tuned through dotted-path knobs and driven by a JSONL workload file."""

import importlib.util
import json
import textwrap

import pytest
import yaml

from autoconfig.cli import main
from autoconfig.serve_config import load_serve_config
from autoconfig.space import SearchSpace
from autoconfig.study import TuningStudy

pytestmark = pytest.mark.integration

MODULE = "swiftserve_it_user_echo"  # importable only inside the app's runtime_env
APP_CODE = textwrap.dedent('''
    import asyncio

    from ray import serve
    from starlette.requests import Request


    @serve.deployment
    class Echo:
        def __init__(self) -> None:
            self.delay_s = 0.0

        def reconfigure(self, config: dict) -> None:
            self.delay_s = config["delay_ms"] / 1000

        async def __call__(self, request: Request) -> dict:
            body = await request.json()
            await asyncio.sleep(self.delay_s)
            return {"echo": body["x"]}


    app = Echo.bind()
''')
SPACE = {"knobs": {"Echo.num_replicas": {"values": [1]}, "Echo.user_config.delay_ms": {"values": [2, 400]}}}


def test_tune_any_serve_app_from_a_workload_file_and_dotted_knobs(base_url, tmp_path):
    code = tmp_path / "app"
    code.mkdir()
    (code / f"{MODULE}.py").write_text(APP_CODE)
    assert importlib.util.find_spec(MODULE) is None  # the CLI cannot import it: Serve imports it in the runtime_env
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": [{
        "name": "echo", "route_prefix": "/echo", "import_path": f"{MODULE}:app",
        "runtime_env": {"working_dir": f"local://{code}"},
        "deployments": [{"name": "Echo", "ray_actor_options": {"num_cpus": 0.1}}],
    }]}))
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    workload = tmp_path / "requests.jsonl"
    workload.write_text("\n".join(json.dumps({"path": "/", "body": {"x": i}}) for i in range(3)) + "\n")
    storage, out = f"sqlite:///{tmp_path / 'studies.db'}", tmp_path / "tuned.yaml"
    argv = ["tune", "--config", str(config), "--app", "echo", "--workload", str(workload), "--space", str(space),
            "--slo-p99-ms", "200", "--budget", "2", "--searcher", "grid", "--storage", storage, "--study", "echo",
            "--probe-s", "1", "--min-requests", "10", "--warmup-s", "0.5", "--start-rps", "4", "--max-probes", "3",
            "--tolerance", "0.5", "--out", str(out)]
    assert main(argv) == 0

    study = TuningStudy.open(storage, "echo", SearchSpace.parse(SPACE))
    records = study.records()
    # First the app as its config has it (no reconfigure: no delay), the baseline of the gain tune prints.
    assert study.starting_point()["status"] == "ok" and study.starting_point()["sustainable_rps"] >= 4
    assert [(r["config"]["Echo.user_config.delay_ms"], r["status"]) for r in records] == [
        (2, "ok"), (400, "slo_violated")]  # a 400 ms answer cannot meet a 200 ms p99
    assert records[0]["sustainable_rps"] >= 4 and records[0]["error_rate"] == 0
    # The one configuration that held the SLO was measured again before it was written (--repeats 2, the default).
    repeated = TuningStudy.open(storage, "echo", SearchSpace.parse(SPACE)).repeats()
    assert [(config["Echo.user_config.delay_ms"], len(runs)) for config, runs in repeated.items()] == [(2, 1)]
    tuned = next(app for app in load_serve_config(out).applications if app.name == "echo")
    echo = next(d for d in tuned.deployments if d.name == "Echo")
    assert echo.user_config == {"delay_ms": 2} and echo.num_replicas == 1
    assert tuned.runtime_env == {"working_dir": f"local://{code}"}  # the app still ships its own code
