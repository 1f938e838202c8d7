"""LoRA files (diffusers/PEFT or kohya-style ``.safetensors``) -> validated, unmerged ``LoRAWeights``.

Keys are normalised by diffusers' own conversions, exactly as the family's pipeline's ``load_lora_weights`` does
(``StableDiffusionPipeline``, ``StableDiffusionXLPipeline``; ``StableDiffusion3Pipeline``, which reads diffusers'
format only, not kohya's; ``FluxPipeline``, which also converts kohya's and XLabs' Flux formats), and each module's
scale is resolved the way diffusers + PEFT would resolve it (the LoRA
config from the file's adapter metadata, else derived by ``get_peft_kwargs``; PEFT's pattern matching per module).
Nothing is injected into a model: the result is plain tensors the engine applies per request.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from json.decoder import scanstring
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from diffusers import (
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
)
from diffusers.utils import (
    convert_state_dict_to_diffusers,
    convert_state_dict_to_peft,
    convert_unet_state_dict_to_peft,
    get_peft_kwargs,
)
from safetensors import safe_open
from torch import nn

from serving.config import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_TENSORS
from serving.lora.weights import LoRALayer, LoRAWeights

if TYPE_CHECKING:
    from serving.presets import ModelFamily

#: Where diffusers' ``save_lora_weights(..., *_lora_adapter_metadata=...)`` stores the LoRA config (JSON).
ADAPTER_METADATA_KEY = "lora_adapter_metadata"
#: diffusers' text-encoder LoRA loader reads ranks of these modules only (``_load_lora_into_text_encoder``).
_TEXT_ENCODER_RANK_MODULES = (".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2")
#: ``LoraConfig`` defaults, for adapter metadata that leaves them out.
_PEFT_DEFAULT_R = 8
_PEFT_DEFAULT_ALPHA = 8
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])\.weight$")
#: rank/alpha pattern keys are regular expressions to PEFT; only literal module paths are accepted here.
_LITERAL_PATTERN = re.compile(r"^\^?[A-Za-z0-9_.]{1,512}$")
#: Weight dtypes that convert to the engine's: not integers, nor packed float4 (torch cannot convert it), nor
#: exponent-only float8_e8m0fnu (a scale format).
_WEIGHT_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                            torch.float8_e5m2})
#: kohya-ss keys of a UNet's blocks (diffusers' or the original checkpoint's names) and of an SD3 MMDiT's.
_KOHYA_UNET_KEY = re.compile(r"^lora_unet_(down_blocks|mid_block|up_blocks|input_blocks|middle_block|output_blocks)_")
_KOHYA_SD3_KEY = re.compile(r"^lora_unet_joint_blocks_")
#: a Flux transformer's blocks in diffusers' (``single_transformer_blocks``), kohya's and XLabs' key styles
_FLUX_KEY = re.compile(r"(^|\.)single_transformer_blocks\.|^lora_unet_(double|single)_blocks_|"
                       r"^(diffusion_model\.)?(double|single)_blocks\.\d+\.")
_UNSUPPORTED_MARKERS = (
    ("dora_scale", "DoRA"),
    ("lora_magnitude_vector", "DoRA"),
    ("lokr_", "LoKr"),
    ("hada_", "LoHa"),
)

#: the down factor of a LoRA on a UNet's cross-attention key projection (whose input is the text conditioning), in
#: diffusers' PEFT, diffusers' older and kohya's key styles
_CROSS_ATTENTION_KEY_DOWN = re.compile(r"attn2[._](?:processor\.)?to_k(?:_lora)?[._](?:lora_A|lora_down|down)\.weight$")
#: a diffusers-format LoRA factor on a module named in full: ``<component>.<module>.lora_A.weight`` (PEFT's down)
#: or ``lora_B`` (up), or diffusers' older ``lora.down`` / ``lora.up``
_MODULE_FACTOR_KEY = re.compile(r"(?P<module>.+)\.(?:lora_(?P<peft>[AB])|lora\.(?P<older>down|up))\.weight")

_HEADER_LENGTH = struct.Struct("<Q")  # safetensors: little-endian u64 header size, then the JSON header
_JSON_WHITESPACE = re.compile(r"[ \t\n\r]*")
_JSON_DECODER = json.JSONDecoder()

Component = Literal["denoiser", "text_encoder", "text_encoder_2"]


class LoRAFormatError(ValueError):
    """A LoRA file that cannot be used with this model; the message names the file and the first bad key."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


@dataclass(frozen=True)
class ModuleShape:
    """What a LoRA needs to know about a target module: its kind and its weight's geometry."""

    kind: Literal["linear", "conv2d"]
    in_features: int
    out_features: int
    kernel_size: tuple[int, int] = (1, 1)

    def factor_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Expected (down, up) shapes for a LoRA of ``rank`` on this module."""
        if self.kind == "linear":
            return (rank, self.in_features), (self.out_features, rank)
        return (rank, self.in_features, *self.kernel_size), (self.out_features, rank, 1, 1)

    def describe(self) -> str:
        if self.kind == "linear":
            return f"Linear({self.in_features}, {self.out_features})"
        return f"Conv2d({self.in_features}, {self.out_features}, kernel={self.kernel_size})"


@dataclass(frozen=True)
class LoRATargets:
    """The modules a LoRA may target, by exact ``named_modules()`` name (shapes only: cheap, picklable)."""

    #: the UNet (sd, sdxl) or the transformer (sd3, flux)
    denoiser: Mapping[str, ModuleShape]
    text_encoder: Mapping[str, ModuleShape]
    #: CLIP keeps its modules under ``text_model.`` (older transformers); when it does not, diffusers strips
    #: that prefix from LoRA keys.
    text_encoder_nested: bool
    #: the model's family: which diffusers pipeline's LoRA format its files are in
    family: ModelFamily
    #: the second CLIP text encoder of sdxl and sd3 (empty for a model with one)
    text_encoder_2: Mapping[str, ModuleShape] = field(default_factory=dict)

    @classmethod
    def from_modules(cls, denoiser: nn.Module, text_encoder: nn.Module,
                     text_encoder_2: nn.Module | None = None) -> LoRATargets:
        """Targets of a model; its family inferred: an ``SD3Transformer2DModel`` denoiser is sd3, a
        ``FluxTransformer2DModel`` flux, else a second text encoder makes sdxl, else sd. (T5 encoders take no LoRA,
        as in diffusers.)"""
        if isinstance(denoiser, SD3Transformer2DModel):
            family = "sd3"
        elif isinstance(denoiser, FluxTransformer2DModel):
            family = "flux"
        else:
            family = "sdxl" if text_encoder_2 is not None else "sd"
        return cls(
            denoiser=_module_shapes(denoiser),
            text_encoder=_module_shapes(text_encoder),
            text_encoder_nested=hasattr(text_encoder, "text_model"),
            family=family,
            text_encoder_2=_module_shapes(text_encoder_2) if text_encoder_2 is not None else {},
        )

    @property
    def denoiser_prefix(self) -> str:
        """The denoiser's key prefix in the family's diffusers LoRA files: ``transformer`` (sd3, flux), else
        ``unet``."""
        return "transformer" if self.family in ("sd3", "flux") else "unet"


def _module_shapes(model: nn.Module) -> dict[str, ModuleShape]:
    shapes: dict[str, ModuleShape] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            shapes[name] = ModuleShape("linear", module.in_features, module.out_features)
        elif isinstance(module, nn.Conv2d) and module.groups == 1:  # LoRA on grouped convolutions: unsupported
            kh, kw = module.kernel_size
            shapes[name] = ModuleShape("conv2d", module.in_channels, module.out_channels, (kh, kw))
    return shapes


@dataclass(frozen=True)
class _LoRAConfig:
    """The part of a PEFT ``LoraConfig`` that decides each module's rank and alpha."""

    r: int
    lora_alpha: float
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    use_rslora: bool

    def rank_and_scale(self, module: str) -> tuple[int, float]:
        """As PEFT's ``LoraModel._create_and_replace`` + ``LoraLayer.update_layer`` resolve them."""
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        return r, alpha / (math.sqrt(r) if self.use_rslora else r)


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str:
    """PEFT's ``get_pattern_key``: the first pattern matching a dotted suffix of ``module`` (else ``module``)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def load_lora_file(path: Path, targets: LoRATargets, *, max_file_bytes: int,
                   max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, max_tensors: int = DEFAULT_MAX_TENSORS,
                   dtype: torch.dtype = torch.float32) -> LoRAWeights:
    """Read, normalise and validate one LoRA file against ``targets``; ``LoRAFormatError`` if it does not fit.

    A file over ``max_file_bytes`` is refused unread; one whose header is over ``max_header_bytes`` or lists more
    than ``max_tensors`` tensors is refused before safetensors parses it.
    """
    path = Path(path)
    name = path.name
    tensors, metadata = _read_safetensors(path, max_file_bytes, max_header_bytes, max_tensors)
    for key in tensors:
        for marker, kind in _UNSUPPORTED_MARKERS:
            if marker in key:
                raise LoRAFormatError(name, f"{key!r}: {kind} adapters are not supported")
    _check_family(name, tensors, targets)
    try:
        if targets.family == "sd3":  # diffusers' format only: no kohya conversion, no network alphas
            state_dict, network_alphas = StableDiffusion3Pipeline.lora_state_dict(tensors), None
        elif targets.family == "flux":  # kohya's and XLabs' keys converted, their alphas folded into the factors
            state_dict, network_alphas = FluxPipeline.lora_state_dict(tensors, return_alphas=True)
        else:
            pipeline = StableDiffusionXLPipeline if targets.family == "sdxl" else StableDiffusionPipeline
            state_dict, network_alphas = pipeline.lora_state_dict(tensors)
    except Exception as exc:  # diffusers' conversion: ValueError, KeyError, ... on malformed files
        raise LoRAFormatError(name, f"not a LoRA diffusers can convert: {exc!r}") from None
    if not state_dict:
        raise LoRAFormatError(name, "the file holds no tensors")
    if network_alphas and metadata:
        raise LoRAFormatError(name, "both kohya alphas and diffusers adapter metadata are present")

    denoiser_name = "transformer" if targets.denoiser_prefix == "transformer" else "UNet"
    components: dict[str, Component] = {targets.denoiser_prefix: "denoiser", "text_encoder": "text_encoder",
                                        "text_encoder_2": "text_encoder_2"}
    split: dict[Component, dict[str, torch.Tensor]] = {component: {} for component in components.values()}
    for key, tensor in state_dict.items():
        prefix, _, rest = key.partition(".")
        if "lora" not in key or prefix not in components or not rest:
            raise LoRAFormatError(name, f"{key!r}: not a {denoiser_name} or text encoder LoRA weight")
        split[components[prefix]][rest] = tensor
    if not split["denoiser"]:
        raise LoRAFormatError(name, f"the file has no {denoiser_name} LoRA weights")
    loader = _ComponentLoader(name, targets, network_alphas, metadata, dtype)
    try:
        denoiser = loader.load("denoiser", split["denoiser"])
    except LoRAFormatError as exc:
        if targets.family == "sdxl" and not split["text_encoder_2"]:  # the UNet of an SD model is not SDXL's
            raise LoRAFormatError(name, f"{exc.reason}; it does not fit this sdxl model: a LoRA for the sd "
                                        "family?") from None
        raise
    text = {component: loader.load(component, split[component]) if split[component] else {}
            for component in ("text_encoder", "text_encoder_2")}
    return LoRAWeights.build(path.stem, denoiser, text["text_encoder"], text["text_encoder_2"])


def check_lora_family(path: Path, targets: LoRATargets, *, max_file_bytes: int,
                      max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, max_tensors: int = DEFAULT_MAX_TENSORS) -> None:
    """``LoRAFormatError`` when the file's header (no tensor is read) shows a LoRA for another model than
    ``targets``': another family's tensor names, a cross-attention key projection of another text-conditioning width
    (any key style), or a diffusers-format denoiser key whose module this model lacks or whose factor shapes differ
    from the module's; or a file ``load_lora_file`` refuses unread. A file that passes may still not fit (the rest
    is checked when it loads)."""
    name = Path(path).name
    shapes = _tensor_shapes(name, _read_header(Path(path), max_file_bytes, max_header_bytes), max_tensors)
    _check_family(name, shapes, targets)
    _check_conditioning_width(name, shapes, targets)
    _check_denoiser_modules(name, shapes, targets)


def _check_conditioning_width(name: str, shapes: Mapping[str, tuple[int, ...]], targets: LoRATargets) -> None:
    """Refuse a LoRA on a UNet's cross-attention key projection whose input width is not this model's text
    conditioning's (SD 1.x: 768, SD 2.x: 1024, SDXL: 2048)."""
    widths = {shape.in_features for module, shape in targets.denoiser.items() if module.endswith("attn2.to_k")}
    if len(widths) != 1:
        return
    (width,) = widths
    for key, shape in shapes.items():
        if _CROSS_ATTENTION_KEY_DOWN.search(key) and len(shape) == 2 and shape[1] != width:
            raise LoRAFormatError(name, f"{key!r} takes a text conditioning {shape[1]} wide, and this "
                                        f"{targets.family} model's is {width}: a LoRA for another model")


def _check_denoiser_modules(name: str, shapes: Mapping[str, tuple[int, ...]], targets: LoRATargets) -> None:
    """Refuse a diffusers-format denoiser key (``unet.<module>.lora_A.weight``, ``....lora.down.weight``) whose
    module name resolves, as the loader resolves it, to no module of this model or to several, or whose factor's
    width is not the module's (down: its input, up: its output)."""
    prefix = f"{targets.denoiser_prefix}."
    for key, shape in shapes.items():
        match = _MODULE_FACTOR_KEY.fullmatch(key)
        if not key.startswith(prefix) or match is None or len(shape) < 2:
            continue
        module, down = match["module"][len(prefix):], match["peft"] == "A" or match["older"] == "down"
        named = _modules_named(module, targets.denoiser)
        if not named:
            raise LoRAFormatError(name, f"{key!r}: this {targets.family} model has no module {module!r}: a LoRA "
                                        "for another model")
        if len(named) > 1:
            raise LoRAFormatError(name, f"{key!r}: {module!r} is ambiguous in this {targets.family} model (it ends "
                                        f"{len(named)} module names)")
        target = targets.denoiser[named[0]]
        width, expected = (shape[1], target.in_features) if down else (shape[0], target.out_features)
        if width != expected:
            raise LoRAFormatError(name, f"{key!r} is {width} wide where {module!r} is {target.describe()}: a LoRA "
                                        "for another model")


def _check_family(name: str, keys: Collection[str], targets: LoRATargets) -> None:
    """Refuse a file whose keys name another family's denoiser or text encoders, saying which family the LoRA is
    for: Flux's transformer blocks (any key style) are flux's, other transformer keys sd3's, UNet keys sd's or
    sdxl's (sdxl's with a second text encoder part). For sd3, also refuse kohya-style keys, which diffusers'
    ``StableDiffusion3Pipeline`` cannot load either."""
    family = targets.family
    if family != "flux" and any(_FLUX_KEY.search(key) for key in keys):
        raise LoRAFormatError(name, f"it has Flux transformer weights: a LoRA for the flux family, and this model is "
                                    f"{family}")
    if family in ("sd", "sdxl"):
        if any(key.startswith("transformer.") or _KOHYA_SD3_KEY.match(key) for key in keys):
            raise LoRAFormatError(name, f"it has SD3 transformer weights: a LoRA for the sd3 family, and this model "
                                        f"is {family}")
        if not targets.text_encoder_2 and _has_second_text_encoder(keys):
            raise LoRAFormatError(name, "it has weights for a second text encoder: a LoRA for the sdxl family, and "
                                        "this model has one text encoder")
        return
    if any(key.startswith("unet.") or _KOHYA_UNET_KEY.match(key) for key in keys):
        unet_family = "sdxl" if _has_second_text_encoder(keys) else "sd or sdxl"
        raise LoRAFormatError(name, f"it has UNet weights: a LoRA for the {unet_family} family, and this model is "
                                    f"{family}")
    if family == "flux":
        if any(_KOHYA_SD3_KEY.match(key) for key in keys):
            raise LoRAFormatError(name, "it has SD3 transformer weights: a LoRA for the sd3 family, and this model "
                                        "is flux")
        if _has_second_text_encoder(keys):
            raise LoRAFormatError(name, "it has weights for a second CLIP text encoder: a LoRA for the sdxl or sd3 "
                                        "family, and this flux model has one")
        return
    kohya = next((key for key in keys if key.startswith("lora_")), None)
    if kohya is not None:
        raise LoRAFormatError(name, f"{kohya!r}: kohya-style LoRA files are not supported for the sd3 family; use "
                                    "diffusers' format (transformer. / text_encoder. / text_encoder_2. keys, as "
                                    "StableDiffusion3Pipeline.save_lora_weights writes them)")


def _has_second_text_encoder(keys: Collection[str]) -> bool:
    """Keys for a second CLIP text encoder, diffusers' (``text_encoder_2.``) or kohya's (``lora_te2_``)."""
    return any(key.startswith(("text_encoder_2.", "lora_te2_")) for key in keys)


def _read_safetensors(path: Path, max_file_bytes: int, max_header_bytes: int,
                      max_tensors: int) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The file's tensors and diffusers' adapter metadata (None when absent). Only ``.safetensors`` is opened."""
    name = path.name
    if path.suffix != ".safetensors":
        raise LoRAFormatError(name, "only .safetensors LoRA files are accepted (pickle formats can run code)")
    _tensor_shapes(name, _read_header(path, max_file_bytes, max_header_bytes), max_tensors)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            header = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - not a dict
    except Exception as exc:  # SafetensorError, OSError, ... : a corrupt or truncated file, lying offsets or shapes
        raise LoRAFormatError(name, f"not a valid safetensors file: {exc}") from None
    raw = header.get(ADAPTER_METADATA_KEY)
    if not raw:
        return tensors, None
    try:
        metadata = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than json can decode
        raise LoRAFormatError(name, f"{ADAPTER_METADATA_KEY!r} metadata is not JSON: {exc}") from None
    if not isinstance(metadata, dict):
        raise LoRAFormatError(name, f"{ADAPTER_METADATA_KEY!r} metadata is not a JSON object")
    return tensors, metadata


def _read_header(path: Path, max_file_bytes: int, max_header_bytes: int) -> bytes:
    """The JSON header of a regular file within ``max_file_bytes`` (else refused unread) whose declared header
    length fits both the file and ``max_header_bytes``."""
    name = path.name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO cannot hang the loader
    except OSError as exc:
        raise LoRAFormatError(name, f"cannot read the file: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LoRAFormatError(name, "not a regular file")
        if info.st_size > max_file_bytes:
            raise LoRAFormatError(name, f"file is {info.st_size} bytes, over the {max_file_bytes}-byte limit")
        prefix = file.read(_HEADER_LENGTH.size)
        if len(prefix) < _HEADER_LENGTH.size:
            raise LoRAFormatError(name, f"not a valid safetensors file: {info.st_size} bytes, shorter than a header")
        (length,) = _HEADER_LENGTH.unpack(prefix)
        if length > info.st_size - _HEADER_LENGTH.size:
            raise LoRAFormatError(name, f"not a valid safetensors file: header length {length} runs past the end "
                                        f"of the {info.st_size}-byte file")
        if length > max_header_bytes:
            raise LoRAFormatError(name, f"header is {length} bytes, over the {max_header_bytes}-byte limit")
        return file.read(length)


def _tensor_shapes(name: str, header: bytes, max_tensors: int) -> dict[str, tuple[int, ...]]:
    """The tensors a JSON header lists, with their shapes (empty where the entry states none as a list of ints),
    refused when there are more than ``max_tensors`` (counting no further than that: a header of a million entries
    costs what ``max_tensors`` entries do). The rest of the header is safetensors' to check."""
    shapes: dict[str, tuple[int, ...]] = {}
    entries = 0  # counted apart from ``shapes``: a key listed twice still counts twice against the limit
    try:
        for key, entry in _top_level_items(header.decode("utf-8")):
            if key != "__metadata__":
                entries += 1
                shape = entry.get("shape") if isinstance(entry, dict) else None
                valid = isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in shape)
                shapes[key] = tuple(shape) if valid else ()
            if entries > max_tensors:
                break
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, JSONDecodeError; nested too deeply
        raise LoRAFormatError(name, f"not a valid safetensors file: the header is not a JSON object: {exc}") from None
    if entries > max_tensors:
        raise LoRAFormatError(name, f"the header lists more than {max_tensors} tensors (the limit)")
    return shapes


def _top_level_items(text: str) -> Iterator[tuple[str, Any]]:
    """The keys and values of the JSON object ``text``, one at a time; ValueError if it is not one. Parsing stops
    where the caller stops asking."""
    char, pos = _next_char(text, 0)
    if char != "{":
        raise ValueError("it does not start with '{'")
    char, pos = _next_char(text, pos)
    if char == "}":
        return
    while char == '"':
        key, pos = scanstring(text, pos)
        char, pos = _next_char(text, pos)
        if char != ":":
            break
        value, pos = _JSON_DECODER.raw_decode(text, _JSON_WHITESPACE.match(text, pos).end())
        yield key, value
        char, pos = _next_char(text, pos)
        if char == "}":
            return
        if char != ",":
            break
        char, pos = _next_char(text, pos)
    raise ValueError(f"malformed object at character {pos - 1}")


def _next_char(text: str, pos: int) -> tuple[str, int]:
    """The first non-whitespace character at or after ``pos`` ('' at the end) and the position after it."""
    pos = _JSON_WHITESPACE.match(text, pos).end()
    return text[pos:pos + 1], pos + 1


class _ComponentLoader:
    """Turns one component's slice of a normalised diffusers state dict into validated ``LoRALayer``s."""

    def __init__(self, name: str, targets: LoRATargets, network_alphas: Mapping[str, float] | None,
                 metadata: Mapping[str, Any] | None, dtype: torch.dtype) -> None:
        self.name = name
        self.targets = targets
        self.network_alphas = network_alphas
        self.metadata = metadata
        self.dtype = dtype

    def prefix(self, component: Component) -> str:
        """The component's key prefix in the file (``unet`` / ``transformer`` for the denoiser)."""
        return self.targets.denoiser_prefix if component == "denoiser" else component

    def error(self, component: Component, key: str, reason: str) -> LoRAFormatError:
        return LoRAFormatError(self.name, f"{self.prefix(component)} {key!r}: {reason}")

    def load(self, component: Component, state_dict: dict[str, torch.Tensor]) -> dict[str, LoRALayer]:
        shapes: Mapping[str, ModuleShape] = getattr(self.targets, component)
        state_dict = self._resolve_modules(component, self._to_peft(component, state_dict), shapes)
        config = self._config(component, state_dict, shapes)
        modules = dict.fromkeys(key.rsplit(".lora_", 1)[0] for key in state_dict)
        return {module: self._layer(component, module, state_dict[f"{module}.lora_A.weight"],
                                    state_dict[f"{module}.lora_B.weight"], shapes[module], config)
                for module in modules}

    def _to_peft(self, component: Component, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """diffusers' key conversion: ``load_lora_adapter`` for the denoiser, ``_load_lora_into_text_encoder``
        else."""
        try:
            if component == "denoiser":
                if "lora_A" not in next(iter(state_dict)):
                    state_dict = convert_unet_state_dict_to_peft(state_dict)
                return state_dict
            state_dict = convert_state_dict_to_peft(convert_state_dict_to_diffusers(state_dict))
        except ValueError as exc:
            raise self.error(component, next(iter(state_dict)), f"unrecognised key layout: {exc}") from None
        if not self.targets.text_encoder_nested:
            state_dict = {key.removeprefix("text_model."): value for key, value in state_dict.items()}
        return state_dict

    def _resolve_modules(self, component: Component, state_dict: dict[str, torch.Tensor],
                         shapes: Mapping[str, ModuleShape]) -> dict[str, torch.Tensor]:
        """The state dict keyed by exact module names (order kept), every key a complete A/B pair."""
        resolved: dict[str, torch.Tensor] = {}
        sources: dict[str, str] = {}  # target module -> the file's module key
        for key, tensor in state_dict.items():
            match = _LORA_KEY.match(key)
            if match is None:
                raise self.error(component, key, _unparsed_key_reason(key))
            if tensor.dtype not in _WEIGHT_DTYPES:
                raise self.error(component, key, f"dtype {tensor.dtype} is not a LoRA weight dtype (float64, "
                                                 "float32, float16, bfloat16, float8_e4m3fn, float8_e5m2)")
            module = self._resolve_module(component, match["module"], shapes)
            if sources.setdefault(module, match["module"]) != match["module"]:
                raise self.error(component, key, f"targets {module!r} again (also {sources[module]!r})")
            resolved[f"{module}.lora_{match['factor']}.weight"] = tensor
        for module, key in sources.items():
            for factor in ("lora_A", "lora_B"):
                if f"{module}.{factor}.weight" not in resolved:
                    raise self.error(component, key, f"has no matching {factor} weight")
        return resolved

    def _resolve_module(self, component: Component, key: str, shapes: Mapping[str, ModuleShape]) -> str:
        """Exact module name, else the unique module whose name ends with ``"." + key``."""
        matches = _modules_named(key, shapes)
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise self.error(component, key, f"ambiguous: matches {', '.join(sorted(matches)[:3])}, ...")
        raise self.error(component, key, "no Linear or Conv2d module of that name in the model")

    def _config(self, component: Component, state_dict: dict[str, torch.Tensor],
                shapes: Mapping[str, ModuleShape]) -> _LoRAConfig:
        """The ``LoraConfig`` diffusers would build: the file's metadata if any, else ``get_peft_kwargs``."""
        prefix = f"{self.prefix(component)}."
        if self.metadata is not None:
            kwargs = {key.removeprefix(prefix): value for key, value in self.metadata.items()
                      if key.startswith(prefix)}
            if not kwargs:
                raise LoRAFormatError(self.name, f"adapter metadata has no {self.prefix(component)} entry")
        else:
            alphas = self.network_alphas
            if component == "denoiser":
                # load_lora_adapter: ranks from every 2-D+ lora_B, keyed "^<key>" (anchored patterns)
                rank = {f"^{key}": value.shape[1] for key, value in state_dict.items()
                        if "lora_B" in key and value.ndim > 1}
                if alphas:
                    alphas = {key.removeprefix(prefix): value for key, value in alphas.items()
                              if key.startswith(prefix)}
            else:
                # _load_lora_into_text_encoder: ranks of attention/MLP projections only, by exact module name
                # (a lora_B under 2-D gives no rank: refused below or by the factor-shape check, not an IndexError)
                ups = {f"{name}.lora_B.weight": state_dict.get(f"{name}.lora_B.weight") for name in shapes
                       if name.endswith(_TEXT_ENCODER_RANK_MODULES)}
                rank = {key: up.shape[1] for key, up in ups.items() if up is not None and up.ndim > 1}
                if alphas is not None:
                    alphas = {key.removeprefix(prefix): value for key, value in alphas.items()
                              if key.split(".")[0] == component}
            if not rank:
                raise LoRAFormatError(self.name, f"no {self.prefix(component)} LoRA module diffusers would take a "
                                                 "rank from")
            kwargs = get_peft_kwargs(rank, alphas, state_dict, is_unet=component == "denoiser")
        try:
            return _parse_config(kwargs)
        except (TypeError, ValueError) as exc:
            raise LoRAFormatError(self.name, f"{self.prefix(component)} LoRA config: {exc}") from None

    def _layer(self, component: Component, module: str, down: torch.Tensor, up: torch.Tensor, shape: ModuleShape,
               config: _LoRAConfig) -> LoRALayer:
        rank = down.shape[0] if down.ndim else 0
        expected_down, expected_up = shape.factor_shapes(rank)
        for factor, tensor, expected in (("lora_A", down, expected_down), ("lora_B", up, expected_up)):
            if tuple(tensor.shape) != expected or rank == 0:
                raise self.error(component, f"{module}.{factor}.weight",
                                 f"shape {tuple(tensor.shape)} does not fit {shape.describe()} (expected {expected})")
        config_rank, scale = config.rank_and_scale(module)
        if config_rank != rank:
            raise self.error(component, module, f"rank {rank} but the LoRA config says r={config_rank}")
        if not math.isfinite(scale):
            raise self.error(component, module, f"scale {scale} is not finite")
        down, up = _owned(down, self.dtype), _owned(up, self.dtype)
        for factor, tensor in (("lora_A", down), ("lora_B", up)):
            if not torch.isfinite(tensor).all():
                raise self.error(component, f"{module}.{factor}.weight", f"non-finite values (in {self.dtype})")
        return LoRALayer(down=down, up=up, scale=float(scale))


def _modules_named(key: str, shapes: Mapping[str, ModuleShape]) -> list[str]:
    """The modules a LoRA key's module name stands for: itself where the model has it, else each module whose name
    ends with ``"." + key`` (how diffusers' loader resolves a key)."""
    if key in shapes:
        return [key]
    return [name for name in shapes if name.endswith("." + key)]


def _unparsed_key_reason(key: str) -> str:
    if key.endswith(".bias"):
        return "LoRA bias terms are not supported"
    if ".lora.down." in key or ".lora.up." in key:
        # load_lora_adapter converts key names only when the first key is not PEFT-style
        return "the file mixes PEFT (lora_A/lora_B) and diffusers (lora.down/lora.up) key names; diffusers " \
               "would silently skip these modules"
    return "not a LoRA A/B weight"


def _parse_config(kwargs: Mapping[str, Any]) -> _LoRAConfig:
    """Validate the fields that matter; refuse LoRA variants this engine cannot apply unmerged."""
    for flag, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA bias terms")):
        if kwargs.get(flag):
            raise ValueError(f"{what} ({flag}) is not supported")
    r = kwargs.get("r", _PEFT_DEFAULT_R)
    alpha = kwargs.get("lora_alpha", _PEFT_DEFAULT_ALPHA)
    rank_pattern = kwargs.get("rank_pattern") or {}
    alpha_pattern = kwargs.get("alpha_pattern") or {}
    use_rslora = kwargs.get("use_rslora", False)
    if not _is_rank(r) or not _is_number(alpha) or not isinstance(use_rslora, bool):
        raise ValueError(f"invalid r={r!r} / lora_alpha={alpha!r} / use_rslora={use_rslora!r}")
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise ValueError("rank_pattern and alpha_pattern must be objects")
    for key in (*rank_pattern, *alpha_pattern):
        if not isinstance(key, str) or not _LITERAL_PATTERN.match(key):
            raise ValueError(f"pattern {key!r}: only literal module paths are supported, not regular expressions")
    if not all(_is_rank(v) for v in rank_pattern.values()) or not all(_is_number(v) for v in alpha_pattern.values()):
        raise ValueError("rank_pattern values must be positive integers and alpha_pattern values numbers")
    return _LoRAConfig(r=r, lora_alpha=float(alpha), rank_pattern=dict(rank_pattern),
                       alpha_pattern={key: float(value) for key, value in alpha_pattern.items()},
                       use_rslora=use_rslora)


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and _is_number(value) and value > 0  # a float too: scales divide by it


def _is_number(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # a JSON integer beyond the float range
        return False


def _owned(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous copy in ``dtype`` with its own storage (never a view of a memory-mapped file)."""
    out = torch.empty(tensor.shape, dtype=dtype)
    out.copy_(tensor)
    return out
