"""Serve application builder: ``import_path: serving.app:build_app`` in a Serve config."""

# No ``from __future__ import annotations``: Ray reads the annotation to validate ``args``.
from ray.serve import Application

from serving.config import DiffusionAppConfig
from serving.deployments.cfg_worker import CFGWorkerDeployment
from serving.deployments.controlnet import ControlNetService
from serving.deployments.ingress import ImagesIngress
from serving.deployments.model import DiffusionModel


def build_app(args: DiffusionAppConfig) -> Application:
    """``ImagesIngress`` -> ``DiffusionModel`` -> ``ControlNet_<name>`` deployments (and ``CFGWorker``).

    Ray validates ``args`` into a ``DiffusionAppConfig``; a plain dict works too.
    """
    if not isinstance(args, DiffusionAppConfig):
        args = DiffusionAppConfig.model_validate(args)
    cores = args.device_map.controlnets if args.device_map else {}
    controlnets = {
        controlnet.name: ControlNetService.options(name=f"ControlNet_{controlnet.name}").bind(
            controlnet, cores.get(controlnet.name, []))
        for controlnet in args.controlnets
    }
    cfg_worker = CFGWorkerDeployment.bind(args, controlnets) if args.engine.cfg_parallel else None
    return ImagesIngress.bind(DiffusionModel.bind(args, controlnets, cfg_worker), args)
