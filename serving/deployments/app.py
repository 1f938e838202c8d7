"""Serve application builder: ``import_path: serving.app:build_app`` in a Serve config."""

# No ``from __future__ import annotations``: Ray reads the annotation to validate ``args``.

from ray.serve import Application

from serving.common.logging import get_logger
from serving.config import DiffusionAppConfig, ImagesAppConfig
from serving.deployments.cfg_worker import CFGWorkerDeployment
from serving.deployments.controlnet import ControlNetService
from serving.deployments.ingress import ImagesIngress
from serving.deployments.model import DiffusionModel
from serving.deployments.model_group import DiffusionModelGroup

logger = get_logger("serving.app")


def build_app(args: DiffusionAppConfig) -> Application:
    """``ImagesIngress`` -> ``DiffusionModel`` -> ``ControlNet_<name>`` deployments (and ``CFGWorker``).

    Ray validates ``args`` into a ``DiffusionAppConfig``; a plain dict works too.
    """
    if not isinstance(args, DiffusionAppConfig):
        args = DiffusionAppConfig.model_validate(args)
    return ImagesIngress.bind([_model(args, "")], ImagesAppConfig(models=[args]))


def build_multi_app(args: ImagesAppConfig) -> Application:
    """Several base models behind one ``ImagesIngress`` (``import_path: serving.app:build_multi_app``): each model's
    deployments as ``build_app`` makes them, named with ``_<model name>`` after them (``DiffusionModel_sdxl-tiny``,
    ``ControlNet_edges_sdxl-tiny``, ``CFGWorker_sdxl-tiny``).
    With ``shared_replicas``, one ``DiffusionModelGroup`` deployment serves every model instead, each model's
    ControlNet services and CFG worker named as above."""
    if not isinstance(args, ImagesAppConfig):
        args = ImagesAppConfig.model_validate(args)
    if args.shared_replicas:
        helpers = {entry.model.name: _helpers(entry, f"_{entry.model.name}") for entry in args.models}
        group = DiffusionModelGroup.bind(args, {name: controlnets for name, (controlnets, _) in helpers.items()},
                                         {name: worker for name, (_, worker) in helpers.items()})
        return ImagesIngress.bind([group], args)
    return ImagesIngress.bind([_model(entry, f"_{entry.model.name}") for entry in args.models], args)


def _model(config: DiffusionAppConfig, suffix: str) -> Application:
    """One model's ``DiffusionModel`` deployment, bound to its ControlNet services and CFG worker."""
    controlnets, cfg_worker = _helpers(config, suffix)
    return DiffusionModel.options(name=f"DiffusionModel{suffix}").bind(config, controlnets, cfg_worker)


def _helpers(config: DiffusionAppConfig, suffix: str) -> tuple[dict[str, Application], Application | None]:
    """One model's ControlNet service deployments by name, and its CFG worker deployment (None: not parallel)."""
    cores = config.device_map.controlnets if config.device_map else {}
    controlnets = {
        controlnet.name: ControlNetService.options(name=f"ControlNet_{controlnet.name}{suffix}").bind(
            controlnet, cores.get(controlnet.name, []))
        for controlnet in config.controlnets
    }
    parallel, why = config.cfg_worker_choice()
    logger.info("model %r: %s", config.model.name, why)
    cfg_worker = (CFGWorkerDeployment.options(name=f"CFGWorker{suffix}").bind(config, controlnets)
                  if parallel else None)
    return controlnets, cfg_worker
