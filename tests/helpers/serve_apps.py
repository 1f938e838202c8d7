"""Applications deployed for one test module beside whatever the session deployed, on the session cluster."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ray import serve
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from autoconfig.serve_config import start_serve, wait_for_applications
from serving.common.net import free_port


@contextmanager
def deployed_beside(apps: list[dict[str, Any]], *, timeout_s: float = 300.0) -> Iterator[int]:
    """Deploys ``apps`` (Serve config ``applications`` entries) next to the running ones and yields Serve's HTTP
    port; afterwards deletes them, or shuts Serve down when it was started here. Serve is left as it was found."""
    try:
        serve.status()
        started_here = False
    except Exception:  # no Serve instance on the cluster yet
        started_here = True
    config = ServeDeploySchema.model_validate({
        "http_options": {"host": "127.0.0.1", "port": free_port()}, "applications": apps,
    })
    names = [app.name for app in config.applications]
    client = start_serve(config)
    instance = client.get_serve_details()
    running = [
        ServeApplicationSchema.model_validate(details["deployed_app_config"])
        for name, details in instance.get("applications", {}).items()
        if name not in names and details.get("deployed_app_config") and details.get("status") != "DELETING"
    ]
    try:
        client.deploy_apps(ServeDeploySchema(applications=[*running, *config.applications],
                                             target_capacity=instance.get("target_capacity")))
        wait_for_applications(names, timeout_s=timeout_s)
        yield client.http_config.port
    finally:
        if started_here:
            serve.shutdown()
        else:
            for name in names:
                serve.delete(name)
