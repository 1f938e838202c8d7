"""The schedulers a request may name, each a diffusers scheduler made from the model's own scheduler config (as
``Scheduler.from_config(pipe.scheduler.config)`` swaps a diffusers pipeline's scheduler), and the scheduler calls
the engine makes as diffusers' pipelines make them (step arguments, noising, an edit's shortened schedule).

A model with a discrete noise schedule (Stable Diffusion 1.x/2.x, SDXL) takes the discrete table; a flow-matching
one (SD3, Flux) the flow table: its own Euler, and the multistep solvers in their flow-sigma form. Flux's pipeline
sets every schedule from its own sigmas, so a Flux model offers only the schedulers that take them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    HeunDiscreteScheduler,
    LMSDiscreteScheduler,
    PNDMScheduler,
    SchedulerMixin,
    UniPCMultistepScheduler,
)

#: The config values a choice sets on top of the model's scheduler config (which it is given).
Overrides = Callable[[Mapping[str, Any]], dict[str, Any]]


def _unchanged(config: Mapping[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class SchedulerChoice:
    """A scheduler class and what it changes in the model's scheduler config."""

    cls: type[SchedulerMixin]
    overrides: Overrides = _unchanged

    def build(self, config: Mapping[str, Any]) -> SchedulerMixin:
        """This scheduler from ``config`` as diffusers' ``from_config`` makes it (the values ``config`` left at
        its class's defaults take this class's), without ``config``'s values this class does not take (warned
        about on every request otherwise)."""
        taken = _init_parameters(self.cls)
        kept = {k: v for k, v in config.items() if k in taken or k.startswith("_")}
        return self.cls.from_config(kept, **self.overrides(config))

    def is_config_of(self, scheduler: SchedulerMixin) -> bool:
        """``scheduler`` is this choice already: its class, with every override already in its config."""
        config = scheduler.config
        return type(scheduler) is self.cls and all(config.get(k) == v for k, v in self.overrides(config).items())


def _flow_solver(config: Mapping[str, Any]) -> dict[str, Any]:
    """A multistep solver on the flow-matching schedule: flow sigmas shifted as the model's Euler shifts them."""
    return {"use_flow_sigmas": True, "prediction_type": "flow_prediction", "flow_shift": config.get("shift", 1.0)}


def _dpmpp_2m(config: Mapping[str, Any]) -> dict[str, Any]:
    return {"algorithm_type": "dpmsolver++", "solver_order": 2}


_DISCRETE: dict[str, SchedulerChoice] = {
    "ddim": SchedulerChoice(DDIMScheduler),
    "dpmpp_2m": SchedulerChoice(DPMSolverMultistepScheduler, _dpmpp_2m),
    "euler": SchedulerChoice(EulerDiscreteScheduler),
    "euler_a": SchedulerChoice(EulerAncestralDiscreteScheduler),
    "heun": SchedulerChoice(HeunDiscreteScheduler),
    "lms": SchedulerChoice(LMSDiscreteScheduler),
    "pndm": SchedulerChoice(PNDMScheduler, lambda config: {"skip_prk_steps": True}),  # as Stable Diffusion ships it
    "unipc": SchedulerChoice(UniPCMultistepScheduler),
}
_FLOW: dict[str, SchedulerChoice] = {
    "dpmpp_2m": SchedulerChoice(DPMSolverMultistepScheduler, lambda config: _dpmpp_2m(config) | _flow_solver(config)),
    "euler": SchedulerChoice(FlowMatchEulerDiscreteScheduler),
    "unipc": SchedulerChoice(UniPCMultistepScheduler, _flow_solver),
}


class SchedulerChoices:
    """The schedulers one model's requests may name, made from its own scheduler ``base``. ``default`` names
    ``base`` itself: its table name when the table has it as it is, else its class name. ``custom_sigmas``: only
    the schedulers whose ``set_timesteps`` takes ``sigmas`` (Flux)."""

    def __init__(self, base: SchedulerMixin, *, custom_sigmas: bool = False) -> None:
        self.base = base
        self.flow = isinstance(base, FlowMatchEulerDiscreteScheduler) or bool(base.config.get("use_flow_sigmas"))
        self._table = {name: choice for name, choice in (_FLOW if self.flow else _DISCRETE).items()
                       if not custom_sigmas or "sigmas" in set_timesteps_parameters(choice.cls)}
        own = [name for name, choice in self._table.items() if choice.is_config_of(base)]
        self.default = own[0] if own else type(base).__name__

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request may give, sorted."""
        return tuple(sorted({*self._table, self.default}))

    def build(self, name: str | None) -> SchedulerMixin:
        """A new scheduler for one request: ``name``'s (None: the model's own). The name must be in ``names``."""
        if name is None or name == self.default:
            return type(self.base).from_config(self.base.config)
        return self._table[name].build(self.base.config)

    def can_edit(self, name: str | None) -> bool:
        """Whether diffusers' edit pipelines run with this scheduler: flow matching noises the source image with
        ``scale_noise``, which only its Euler scheduler has."""
        scheduler_cls = type(self.base) if name is None or name == self.default else self._table[name].cls
        return not self.flow or hasattr(scheduler_cls, "scale_noise")


@functools.cache
def _init_parameters(scheduler_cls: type[SchedulerMixin]) -> frozenset[str]:
    return frozenset(inspect.signature(scheduler_cls.__init__).parameters)


@functools.cache
def set_timesteps_parameters(scheduler_cls: type[SchedulerMixin]) -> frozenset[str]:
    """What ``scheduler_cls.set_timesteps`` takes."""
    return frozenset(inspect.signature(scheduler_cls.set_timesteps).parameters)


@functools.cache
def _step_parameters(scheduler_cls: type[SchedulerMixin]) -> frozenset[str]:
    return frozenset(inspect.signature(scheduler_cls.step).parameters)


def step_kwargs(scheduler: SchedulerMixin, generators: list[torch.Generator]) -> dict[str, Any]:
    """What diffusers' pipelines pass to ``scheduler.step`` besides the prediction (``prepare_extra_step_kwargs``):
    ``eta`` 0 and the request's generators, each where this scheduler's class takes it."""
    parameters = _step_parameters(type(scheduler))
    kwargs: dict[str, Any] = {}
    if "eta" in parameters:
        kwargs["eta"] = 0.0
    if "generator" in parameters:
        kwargs["generator"] = generators
    return kwargs


def noised(scheduler: SchedulerMixin, latents: torch.Tensor, noise: torch.Tensor,
           timestep: torch.Tensor) -> torch.Tensor:
    """``latents`` noised to ``timestep`` [1 or n] as the edit pipelines do it: flow matching's ``scale_noise``,
    else ``add_noise``."""
    scale_noise = getattr(scheduler, "scale_noise", None)
    if scale_noise is not None:
        return scale_noise(latents, timestep, noise)
    return scheduler.add_noise(latents, noise, timestep)


def edit_start(steps: int, strength: float, *, flow: bool) -> int:
    """The step an edit of ``strength`` starts at, of ``steps`` (diffusers' ``get_timesteps``: SD and SDXL run
    ``int(steps * strength)`` steps; SD3 skips ``int(steps - steps * strength)``). ``steps`` when none is left."""
    kept = min(steps * strength, steps) if flow else min(int(steps * strength), steps)
    return int(max(steps - kept, 0))


def edit_timesteps(scheduler: SchedulerMixin, start: int) -> torch.Tensor:
    """The timesteps of ``scheduler``'s schedule from step ``start`` on, the scheduler told where it begins."""
    begin = start * scheduler.order
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(begin)
    return scheduler.timesteps[begin:]
