"""Where a served model comes from: a DLRM preset or a user factory, built whole or one part at a time.

Every process of an application (dense replicas, embedding shards, monolithic replicas, ``autoconfig check``) builds
the model's structure alone (``skeleton``: parameters on the meta device), cuts it, and gives only the part it holds
its values (``materialize``): each shard reads only its own tables from a weights file.
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from disagg.config import DLRMModelConfig
from disagg.model import DLRM, check_weights_header, materialize_
from disagg.signature import ModelSignature, dlrm_signature
from disagg.spec import preset_spec
from disagg.tables import weights_source


class ModelError(ValueError):
    """A served model that cannot be built or served as configured; ``key`` is the config key at fault."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class ModelSource(abc.ABC):
    """Builds one served model, whole or in parts, with the same values in every process."""

    #: The served tensors.
    signature: ModelSignature
    #: What is served, for logs (a preset name or a factory).
    label: str

    @abc.abstractmethod
    def skeleton(self) -> nn.Module:
        """The model's structure: parameters on the meta device (buffers and constants real), nothing read."""

    @abc.abstractmethod
    def materialize(self, module: nn.Module, only: Collection[str] | None = None) -> nn.Module:
        """Gives ``module`` (the skeleton or a part cut from it) the model's values in place; ``only``: just the
        parameters of these submodules (qualified names, e.g. a table), the rest left as they are."""

    @property
    @abc.abstractmethod
    def version_source(self) -> str:
        """What the values come from (``disagg.tables.weights_source``): equal in every process of the app."""

    def build(self) -> nn.Module:
        """The whole model with its values."""
        return self.materialize(self.skeleton())


class PresetSource(ModelSource):
    """A DLRM preset: seeded per-layer initialisation or a weights file (``disagg.model.materialize_``)."""

    def __init__(self, preset: str, seed: int = 0, weights: str | os.PathLike | None = None) -> None:
        self.spec = preset_spec(preset)
        self.seed, self.weights, self.label = seed, weights, preset
        self.signature = dlrm_signature(self.spec.num_dense, self.spec.num_tables)

    def skeleton(self) -> nn.Module:
        return DLRM(self.spec, device="meta")

    def materialize(self, module: nn.Module, only: Collection[str] | None = None) -> nn.Module:
        return materialize_(module, seed=self.seed, weights=self.weights, only=only)

    @property
    def version_source(self) -> str:
        return weights_source(self.seed, self.weights)


class FactorySource(ModelSource):
    """A user model: ``factory()`` returns the ``nn.Module``. With a weights file (its ``state_dict`` as safetensors)
    the factory runs with parameters on the meta device and each part reads its parameters and persistent buffers
    from the file (a parameter the factory initialised on the CPU anyway is overwritten); without, it runs under
    ``torch.manual_seed(seed)`` and its own initialisation gives the values (every process builds the whole
    model)."""

    def __init__(self, factory: str, seed: int, weights: str | os.PathLike | None, signature: ModelSignature) -> None:
        self.factory, self.seed, self.weights, self.signature, self.label = factory, seed, weights, signature, factory
        self._call = load_factory(factory)

    def skeleton(self) -> nn.Module:
        if self.weights is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                return self._checked(self._call())
        with parameters_on_meta():
            return self._checked(self._call())

    def materialize(self, module: nn.Module, only: Collection[str] | None = None) -> nn.Module:
        if self.weights is None:  # the skeleton already holds the factory's own values
            return module
        return load_parameters(module, self.weights, only=only)

    @property
    def version_source(self) -> str:
        return weights_source(self.seed, self.weights) + f"|factory:{self.factory}"

    def _checked(self, module: Any) -> nn.Module:
        if not isinstance(module, nn.Module):
            raise ModelError("model.factory", f"{self.factory} returned {type(module).__name__}, not a torch nn.Module")
        return module.eval()


def model_source(config: DLRMModelConfig) -> ModelSource:
    """The source of the model ``config`` names."""
    weights = config.weights_path()
    if config.factory is None:
        return PresetSource(str(config.preset), config.seed, weights)
    return FactorySource(config.factory, config.seed, weights, config.signature())


def load_factory(factory: str) -> Callable[[], Any]:
    """The function ``package.module:function`` or ``/path/file.py:function`` names; ModelError saying why not."""
    location, _, name = factory.rpartition(":")
    try:
        module = _import_file(Path(location)) if location.endswith(".py") else importlib.import_module(location)
    except ModelError:
        raise
    except Exception as exc:  # the user's module failed to import: say which and why
        raise ModelError("model.factory", f"cannot import {location!r}: {type(exc).__name__}: {exc}") from None
    function = getattr(module, name, None)
    if function is None:
        raise ModelError("model.factory", f"{location!r} has no attribute {name!r}")
    if not callable(function):
        raise ModelError("model.factory", f"{factory} is not callable: it is of type {type(function).__name__}")
    return function


def _import_file(path: Path) -> Any:
    """The module of the Python file ``path``, imported once per process under a name derived from the path."""
    if not path.is_absolute():
        raise ModelError("model.factory", f"{path} is not an absolute path")
    if not path.is_file():
        raise ModelError("model.factory", f"file not found: {path}")
    name = "swiftserve_user_model_" + hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py path always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so classes defined there pickle and trace by their module's name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within it, every parameter a module registers moves to the meta device (its initialisation then costs
    nothing); buffers and other tensors stay where they are made."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, parameter: nn.Parameter | None) -> None:
        register(module, name, parameter)
        if parameter is not None and not parameter.is_meta:
            module._parameters[name] = nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@torch.no_grad()
def load_parameters(module: nn.Module, weights: str | os.PathLike, only: Collection[str] | None = None) -> nn.Module:
    """Reads ``module``'s parameters (the skeleton or a part of it: qualified names are the model's), on whatever
    device they are, and the buffers the file holds from the safetensors ``state_dict`` file ``weights``; with
    ``only``, just those of these submodules. A tensor tied under several names is read under any of them the file
    holds (``safetensors.torch.save_model`` keeps one) and stays tied. Buffers the file lacks (non-persistent ones)
    keep their values. A parameter or meta buffer the file lacks or holds in another shape is a ModelError naming
    it."""
    if not Path(weights).is_file():
        raise ModelError("model.weights", f"file not found: {weights}")
    try:
        check_weights_header(weights)
        handle = safe_open(os.fspath(weights), framework="pt", device="cpu")
    except (ValueError, SafetensorError) as exc:
        raise ModelError("model.weights", f"{weights}: not a valid safetensors file: {exc}") from None
    prefixes = None if only is None else tuple(f"{name}." for name in only)
    aliases: dict[int, list[str]] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for key, tensor in named:
        aliases.setdefault(id(tensor), []).append(key)
    loaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by the tensor replaced (kept alive): ties stay tied
    with handle:
        keys = set(handle.keys())
        for owner_name, owner in module.named_modules():
            for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]:
                key = f"{owner_name}.{name}" if owner_name else name
                if tensor is None or (prefixes is not None and not key.startswith(prefixes)):
                    continue
                parameter = name in owner._parameters
                if id(tensor) in loaded:
                    (owner._parameters if parameter else owner._buffers)[name] = loaded[id(tensor)][1]
                    continue
                key = next((alias for alias in aliases[id(tensor)] if alias in keys), key)
                if key not in keys:
                    if parameter or tensor.is_meta:
                        raise ModelError("model.weights", f"{weights} holds no tensor {key!r}")
                    continue
                value = handle.get_tensor(key)
                if value.shape != tensor.shape:
                    raise ModelError("model.weights", f"{key!r} is {tuple(value.shape)} in {weights}, the model's is "
                                     f"{tuple(tensor.shape)}")
                value = value.to(tensor.dtype)
                if parameter:
                    value = nn.Parameter(value, requires_grad=tensor.requires_grad)
                    owner._parameters[name] = value
                else:
                    owner._buffers[name] = value
                loaded[id(tensor)] = (tensor, value)
    return module
