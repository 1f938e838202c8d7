"""Validated configuration of the diffusion application, one model per concern.

The Serve config's ``args:`` for ``serving.app:build_app`` is a ``DiffusionAppConfig``; environment
variables enter only through ``serving.common.constants``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator, model_validator

from serving.preset_catalog import PRESET_NAMES, WeightsChoice, preset_weights

#: Defaults of ``ImageLimits.max_image_side`` and ``LoRAConfig.max_header_bytes`` / ``max_tensors``, also used by
#: the code that enforces them (``serving.images``, ``serving.lora``) when called without a config.
DEFAULT_MAX_SIDE = 8192
DEFAULT_MAX_HEADER_BYTES = 8 * 2**20
DEFAULT_MAX_TENSORS = 16384


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class _ModelSource(_Config):
    """A model built from a seeded preset or loaded from a local diffusers directory, on one device."""

    preset: str | None = Field("tiny", description=f"Built-in preset, one of {PRESET_NAMES}; null with `path`.")
    path: Path | None = Field(None, description="Local diffusers directory; loaded with local_files_only.")
    weights: WeightsChoice = Field(
        "auto", description="A preset's weights: `auto` = its shipped trained weights where it has some (`tiny`: "
                            "trained on the shapes world, serving/weights/tiny/), else seeded; `seeded` = always "
                            "drawn from `seed`.")
    seed: int = Field(0, ge=0, description="Seed of a preset's random weights.")
    device: str = Field("auto", description="torch device; `auto` = SWIFTSERVE_DEVICE, else CUDA if present, else CPU.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="Weights and compute dtype.")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads of the replica; null: torch's default (Ray sets "
                                "OMP_NUM_THREADS from the replica's num_cpus).")

    def _sources(self) -> dict[str, object]:
        """Where the weights may come from, by field: exactly one is set."""
        return {"preset": self.preset, "path": self.path}

    @model_validator(mode="after")
    def _one_source(self) -> _ModelSource:
        sources = self._sources()
        given = [name for name, value in sources.items() if value is not None]
        if len(given) != 1:
            named = ", ".join(f"`{name}`" for name in sources)
            raise ValueError(f"set exactly one of {named}" + (f" (set: {', '.join(given)})" if given else ""))
        if self.preset is not None and self.preset not in PRESET_NAMES:
            raise ValueError(f"unknown preset {self.preset!r}; known presets: {', '.join(PRESET_NAMES)}")
        return self


class DiffusionModelConfig(_ModelSource):
    """Which base model a replica loads and where it runs."""

    name: str = Field("tiny", pattern=_NAME, description="Model id clients send as `model` and see in GET /v1/models.")
    single_file: Path | None = Field(
        None, description="A .safetensors checkpoint in its original training layout (SD 1.x/2.x, SDXL, Flux); "
                          "needs `config`.")
    config: str | None = Field(
        None, description="With `single_file`: what the file lacks (configs, tokenizers, a Flux file's encoders and "
                          "VAE): a preset of the file's family, or a local diffusers directory of it.")

    def _sources(self) -> dict[str, object]:
        return {**super()._sources(), "single_file": self.single_file}

    @model_validator(mode="after")
    def _config_goes_with_single_file(self) -> DiffusionModelConfig:
        if (self.single_file is None) != (self.config is None):
            raise ValueError("`single_file` needs `config` (a preset name or a local diffusers directory), and "
                             "`config` is only for `single_file`")
        if self.single_file is not None and self.single_file.suffix != ".safetensors":
            raise ValueError("single_file: only .safetensors checkpoints are loaded (a pickled .ckpt can run code "
                             "when it loads)")
        return self

    def source(self) -> str:
        """Where the model comes from, for logs."""
        if self.single_file is not None:
            return f"single_file={self.single_file} config={self.config}"
        return f"preset={self.preset}" if self.preset is not None else f"path={self.path}"


class ControlNetConfig(_ModelSource):
    """One ControlNet, served as its own deployment and shared by every base-model replica."""

    name: str = Field(..., pattern=_NAME, description="Name requests use in `controlnets[].name`.")
    max_batch_size: int = Field(8, ge=1, description="Calls (from any requests and steps) merged per forward.")
    batch_wait_timeout_s: float = Field(0.002, ge=0.0, description="How long a call waits for others to batch.")


#: How a request waits for LoRAs not in memory (``GenerationDefaults.lora_mode`` describes both).
LoRAMode = Literal["async", "exact"]


class GenerationDefaults(_Config):
    """Values used when a request leaves the field out."""

    num_inference_steps: int = Field(20, ge=1, description="Denoising steps.")
    guidance_scale: float = Field(7.5, ge=0.0, description="Classifier-free guidance scale.")
    lora_mode: LoRAMode = Field(
        "async", description="`async`: a LoRA not in memory loads while the request denoises without it, applied "
                             "from the first step after the load; `exact`: the request waits for its LoRAs before "
                             "its first step (seed-reproducible images).")
    edit_strength: float = Field(
        0.8, gt=0.0, le=1.0, description="`strength` of an edit without a mask: how far into the noise schedule it "
                                         "starts (diffusers' image-to-image default).")
    inpaint_strength: float = Field(
        1.0, gt=0.0, le=1.0, description="`strength` of an edit with a mask (diffusers' inpainting default).")


class ImageLimits(_Config):
    """Bounds on what one request may ask for; requests beyond them get a 400 naming the field."""

    max_n: int = Field(4, ge=1, description="Images per request.")
    max_steps: int = Field(100, ge=1, description="num_inference_steps upper bound.")
    max_side: int = Field(1024, ge=8, description="Largest width or height in pixels.")
    max_prompt_chars: int = Field(2000, ge=1, description="Longest prompt or negative_prompt.")
    max_guidance_scale: float = Field(30.0, gt=0.0, description="guidance_scale upper bound.")
    max_body_bytes: int = Field(16 * 2**20, ge=1024, description="Largest request body.")
    max_loras: int = Field(4, ge=0, description="LoRAs per request.")
    max_controlnets: int = Field(3, ge=0, description="ControlNets per request.")
    max_conditioning_scale: float = Field(4.0, gt=0.0, description="Largest absolute ControlNet conditioning scale.")
    max_image_bytes: int = Field(8 * 2**20, ge=1, description="Largest conditioning or edit image (or mask) file.")
    max_image_pixels: int = Field(2048 * 2048, ge=1, description="Largest conditioning or edit image (width x height).")
    max_image_side: int = Field(
        DEFAULT_MAX_SIDE, ge=8,
        description="Longest conditioning or edit image side: an image within `max_image_pixels` but of an extreme "
                    "aspect ratio (1 x 4M) takes five times the CPU and three times the memory to preprocess and "
                    "resize.")
    max_lora_scale: float = Field(4.0, gt=0.0, description="Largest absolute LoRA scale.")


class CFGWorkerConfig(_Config):
    """How the `CFGWorker` deployment merges the calls of every model replica into denoiser forwards, and how long a
    model replica relies on it."""

    max_batch_size: int = Field(
        8, ge=1, description="Calls (from any model replica and step) merged per forward; calls of other latent "
                             "sizes in the same batch get their own forward.")
    batch_wait_timeout_s: float = Field(0.002, ge=0.0, description="How long a call waits for others to batch.")
    patience: float = Field(
        4.0, gt=0.0, description="Once a model replica's own rows of a step are done, it waits for the worker's at "
                                 "most this many times as long as its own took (at least `min_wait_s`), then computes "
                                 "them itself: a dead or stalled worker slows a step, it never stalls it.")
    min_wait_s: float = Field(0.5, ge=0.0, description="Least time a model replica waits for the worker's rows.")
    retry_after_s: float = Field(
        1.0, gt=0.0, description="After the worker fails or keeps a step waiting, the model replica computes every "
                                 "row itself this long before it calls the worker again; doubled per failure in a "
                                 "row, up to `max_retry_after_s`.")
    max_retry_after_s: float = Field(30.0, gt=0.0, description="Longest pause between calls to a failing worker.")

    @model_validator(mode="after")
    def _retry_bounds(self) -> CFGWorkerConfig:
        if self.max_retry_after_s < self.retry_after_s:
            raise ValueError(f"max_retry_after_s ({self.max_retry_after_s}) must be at least retry_after_s "
                             f"({self.retry_after_s})")
        return self


class EngineConfig(_Config):
    """How a model replica schedules denoising work."""

    max_batch_rows: int = Field(16, ge=1, description="Most denoiser rows per step (an image with CFG takes two).")
    continuous_batching: bool = Field(
        True, description="Admit requests at every step boundary; off: only when the replica is idle.")
    max_skipped_steps: int = Field(
        8, ge=1, description="Fairness bound: a runnable request passed over this many steps in a row (its image "
                             "size is not the one being batched, or its rows did not fit) anchors the next step.")
    remote_timeout_s: float = Field(
        30.0, gt=0.0, description="Deadline of one step's call to a ControlNet or CFG worker deployment; past it "
                                  "the requests using the ControlNet fail with 503 (the CFG worker's rows are "
                                  "computed by the replica itself) and the replica goes on.")
    cfg_parallel: bool | Literal["auto"] = Field(
        "auto", description="Run the unconditional CFG rows on a second worker (the `CFGWorker` deployment) while "
                            "this replica runs the conditional ones. It pays only when the worker has a device of its "
                            "own: `auto` turns it on only where `device_map.cfg_worker` gives the worker cores no "
                            "`device_map.model` entry uses, and says why when it does not; `true` always (on GPUs, "
                            "give the worker a whole GPU); `false` never.")
    cfg_worker: CFGWorkerConfig = Field(
        CFGWorkerConfig(), description="Batching of the `CFGWorker` deployment (with `cfg_parallel`).")
    lora_wait_fraction: float = Field(
        0.4, ge=0.0, le=1.0,
        description="A request whose LoRA is still loading runs without it until this fraction of its steps, "
                    "then waits for it (Katz: 20 of 50 steps).")
    preview_decoder: Literal["approx", "vae"] = Field(
        "approx", description="How a streamed request's partial images are decoded: `approx`, a linear latent-to-RGB "
                              "map fitted to the model's VAE once (well under a millisecond per image; colours and "
                              "layout, not detail), or `vae`, a full VAE decode per preview (exact, as costly as the "
                              "final decode).")
    admission_wait_fraction: float | None = Field(
        0.25, ge=0.0,
        description="A request predicted to wait more than this fraction of its own steps before its first "
                    "(the model is past capacity) is refused at once with 503 `overloaded` and the predicted wait "
                    "as `Retry-After`, so admitted requests keep their latency. null: admit every request the "
                    "Serve queues let through.")
    admission_max_slowdown: float | None = Field(
        None, ge=1.0,
        description="While the model is busy, refuse at once (503 `overloaded`) a request whose denoising is "
                    "predicted to take more than this many times as long as alone: its wait and its own steps at "
                    "the current step time (which shared cores and full batches stretch) against its steps at the "
                    "fastest step time seen for a batch of at least its rows. null: off.")


class EngineTuning(_Config):
    """The engine settings a running replica takes live, as its Serve ``user_config`` (unset: unchanged)."""

    max_batch_rows: int | None = Field(None, ge=1, description="Most denoiser rows per step.")
    continuous_batching: bool | None = Field(None, description="Admit requests at every step boundary.")
    max_skipped_steps: int | None = Field(None, ge=1, description="See `EngineConfig`.")
    lora_wait_fraction: float | None = Field(None, ge=0.0, le=1.0, description="See `EngineConfig`.")
    admission_wait_fraction: float | None = Field(None, ge=0.0, description="See `EngineConfig`.")
    admission_max_slowdown: float | None = Field(None, ge=1.0, description="See `EngineConfig`.")

    def apply(self, engine: EngineConfig) -> EngineConfig:
        """``engine`` with the fields set here replaced."""
        return engine.model_copy(update=self.model_dump(exclude_none=True))


class LoRAConfig(_Config):
    """Where LoRAs come from and how many stay in host memory."""

    directory: Literal["bundled"] | Path | None = Field(
        None, description="Directory of `<name>.safetensors` LoRA files; new files are picked up live. "
                          "`bundled`: the LoRAs shipped with the model (the `loras/` folder of its trained preset "
                          "or of its local directory). null: no LoRAs.")
    cache_bytes: int = Field(2 * 2**30, ge=0, description="Host-memory LRU budget for loaded LoRAs.")
    max_file_bytes: int = Field(1 * 2**30, ge=1, description="Larger LoRA files are refused unread.")
    max_header_bytes: int = Field(
        DEFAULT_MAX_HEADER_BYTES, ge=2,
        description="Largest safetensors header (the JSON before the tensor data, training metadata included); "
                    "a file with a larger one is refused before it is parsed.")
    max_tensors: int = Field(
        DEFAULT_MAX_TENSORS, ge=1,
        description="Most tensors in one LoRA file (a kohya SDXL LoRA has about 3,500); a file listing more is "
                    "refused after counting only this many.")
    load_workers: int = Field(2, ge=1, description="Background threads loading LoRA files.")
    merged_cache_bytes: NonNegativeInt | Literal["auto"] = Field(
        "auto",
        description="Device memory for merged weight copies, used when every row of a denoiser batch has the same "
                    "LoRAs (no per-step LoRA cost). `auto`: the weights of every module the LoRAs in use target, so "
                    "any one combination runs wholly merged, at most half the device memory free once the model is "
                    "loaded (a warning says when that cap binds); 0: always apply LoRAs unmerged.")
    merge_after_forwards: int = Field(
        8, ge=0,
        description="Denoiser forwards a LoRA combination runs unmerged before its merged copy is built (building "
                    "costs about as much as a few unmerged steps).")


#: The CPU cores one replica runs on.
Cores = list[NonNegativeInt]


def _check_core_sets(entries: list[Cores], where: str = "") -> list[Cores]:
    for index, cores in enumerate(entries):
        if not cores:
            raise ValueError(f"{where}entry {index} lists no core")
        if len(set(cores)) != len(cores):
            raise ValueError(f"{where}entry {index} lists a core twice: {cores}")
    return entries


class DeviceMap(_Config):
    """CPU cores per replica, the CPU stand-in for one device per worker: a replica with an entry runs all its
    threads on those cores with one torch thread per core. A deployment without entries is not pinned. Cores
    are checked against the machine when the replica starts (it fails with the reason)."""

    model: list[Cores] = Field(
        default_factory=list,
        description="Cores of each `DiffusionModel` replica by its rank on its node: replica r uses entry "
                    "r % len. Empty: not pinned. The model's `torch_threads` must then be null: the core count "
                    "sets the threads.")
    cfg_worker: list[Cores] = Field(
        default_factory=list,
        description="Cores of each `CFGWorker` replica, by rank as `model`; not with `engine.cfg_parallel: false`. "
                    "The model's `torch_threads` must then be null.")
    controlnets: dict[str, list[Cores]] = Field(
        default_factory=dict,
        description="Cores of each `ControlNet_<name>` replica by ControlNet name, by rank as `model`; that "
                    "ControlNet's `torch_threads` must then be null.")

    @field_validator("model", "cfg_worker")
    @classmethod
    def _core_sets(cls, entries: list[Cores]) -> list[Cores]:
        return _check_core_sets(entries)

    @field_validator("controlnets")
    @classmethod
    def _controlnet_core_sets(cls, entries: dict[str, list[Cores]]) -> dict[str, list[Cores]]:
        for name, core_sets in entries.items():
            _check_core_sets(core_sets, f"{name}: ")
        return entries


class DiffusionAppConfig(_Config):
    """Everything ``serving.app:build_app`` needs, as written under ``args:`` in a Serve config."""

    model: DiffusionModelConfig = DiffusionModelConfig()
    defaults: GenerationDefaults = GenerationDefaults()
    limits: ImageLimits = ImageLimits()
    engine: EngineConfig = EngineConfig()
    lora: LoRAConfig = LoRAConfig()
    controlnets: list[ControlNetConfig] = Field(default_factory=list, description="ControlNet services.")
    device_map: DeviceMap | None = Field(
        None, description="CPU cores of each replica (`DeviceMap`); null: replicas are not pinned.")

    @model_validator(mode="after")
    def _unique_controlnets(self) -> DiffusionAppConfig:
        names = [controlnet.name for controlnet in self.controlnets]
        if len(names) != len(set(names)):
            raise ValueError("controlnets: names must be unique")
        return self

    @model_validator(mode="after")
    def _controlnet_presets_fit_the_model(self) -> DiffusionAppConfig:
        """A ControlNet preset is built for the denoiser of the diffusion preset of its name (its family and sizes)."""
        for index, controlnet in enumerate(self.controlnets):
            if controlnet.preset is not None and self.model.preset is not None and controlnet.preset != \
                    self.model.preset:
                raise ValueError(f"controlnets[{index}].preset {controlnet.preset!r} is built for the "
                                 f"{controlnet.preset!r} model, not model.preset {self.model.preset!r}")
        return self

    @model_validator(mode="after")
    def _bundled_loras_exist(self) -> DiffusionAppConfig:
        if self.lora.directory == "bundled" and self.bundled_lora_directory() is None:
            raise ValueError("lora.directory: `bundled` needs a model with a `loras/` folder (the `tiny` preset "
                             "with weights `auto`, or a local directory that has one)")
        return self

    @model_validator(mode="after")
    def _device_map_matches(self) -> DiffusionAppConfig:
        device_map = self.device_map
        if device_map is None:
            return self
        configured = {controlnet.name: controlnet for controlnet in self.controlnets}
        unknown = sorted(set(device_map.controlnets) - set(configured))
        if unknown:
            raise ValueError(f"device_map.controlnets: {unknown} are not configured controlnets "
                             f"(configured: {sorted(configured)})")
        if device_map.cfg_worker and self.engine.cfg_parallel is False:
            raise ValueError("device_map.cfg_worker: there is no CFG worker with engine.cfg_parallel: false")
        threads = "must be null with a device map, which runs one torch thread per pinned core"
        if (device_map.model or device_map.cfg_worker) and self.model.torch_threads is not None:
            raise ValueError(f"model.torch_threads {threads} (device_map.model, device_map.cfg_worker)")
        for index, controlnet in enumerate(self.controlnets):
            if device_map.controlnets.get(controlnet.name) and controlnet.torch_threads is not None:
                raise ValueError(f"controlnets[{index}].torch_threads {threads} "
                                 f"(device_map.controlnets.{controlnet.name})")
        return self

    def model_cores(self) -> list[Cores]:
        """``device_map.model``, or no entries without a device map (not pinned)."""
        return self.device_map.model if self.device_map else []

    def cfg_worker_choice(self) -> tuple[bool, str]:
        """Whether this model gets a ``CFGWorker`` deployment (``engine.cfg_parallel``), and why."""
        choice = self.engine.cfg_parallel
        if choice != "auto":
            return choice, f"engine.cfg_parallel: {str(choice).lower()}"
        worker = {core for cores in self.device_map.cfg_worker for core in cores} if self.device_map else set()
        if not worker:
            return False, ("engine.cfg_parallel auto: off, no device of its own is known for a CFG worker "
                           "(device_map.cfg_worker is unset; on GPUs give the worker a whole GPU and set "
                           "engine.cfg_parallel: true)")
        shared = sorted(worker & {core for cores in self.device_map.model for core in cores})
        if shared:
            return False, (f"engine.cfg_parallel auto: off, device_map.cfg_worker shares cores {shared} with "
                           "device_map.model (one device computing both branches in turn is slower than one "
                           "batch of both)")
        return True, f"engine.cfg_parallel auto: on, the CFG worker has cores {sorted(worker)} of its own"

    def bundled_lora_directory(self) -> Path | None:
        """The model's own ``loras/`` folder, where it has one."""
        model = self.model
        root = model.path if model.path is not None else (
            preset_weights(model.preset) if model.preset is not None and model.weights == "auto" else None)
        return root / "loras" if root is not None and (root / "loras").is_dir() else None

    def lora_directory(self) -> Path | None:
        """Where LoRA files are looked up (``bundled`` resolved); None: no LoRAs."""
        return self.bundled_lora_directory() if self.lora.directory == "bundled" else self.lora.directory

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> DiffusionAppConfig:
        if self.defaults.num_inference_steps > self.limits.max_steps:
            raise ValueError("defaults.num_inference_steps exceeds limits.max_steps")
        if self.defaults.guidance_scale > self.limits.max_guidance_scale:
            raise ValueError("defaults.guidance_scale exceeds limits.max_guidance_scale")
        return self


class ImagesAppConfig(_Config):
    """Several base models behind one Images API (``serving.app:build_app`` args with ``models``): a request's
    ``model`` picks one, the first when it names none. Each entry configures one model as a one-model app would
    (its ControlNets, LoRA directory, engine, defaults and limits)."""

    models: list[DiffusionAppConfig] = Field(..., min_length=1, description="The served base models, default first.")
    shared_replicas: bool = Field(
        False, description="One deployment, `DiffusionModelGroup`, whose every replica serves all the models: their "
                           "engine loops take turns at the replica's cores a step at a time (earliest ideal finish "
                           "first) and each model's admission counts the work of the others that goes first. Off: a "
                           "`DiffusionModel_<name>` deployment per model. The models' `device_map.model` must be equal "
                           "(the group's replicas are pinned by it).")

    @model_validator(mode="after")
    def _unique_model_names(self) -> ImagesAppConfig:
        names = [entry.model.name for entry in self.models]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"models: each model.name must be unique; repeated: {', '.join(repeated)}")
        return self

    @model_validator(mode="after")
    def _shared_replicas_share_cores(self) -> ImagesAppConfig:
        if self.shared_replicas:
            first = self.group_cores()
            for entry in self.models[1:]:
                if entry.model_cores() != first:
                    raise ValueError(f"shared_replicas: every model's device_map.model must be equal; "
                                     f"{entry.model.name!r} has {entry.model_cores()}, "
                                     f"{self.models[0].model.name!r} {first}")
        return self

    def group_cores(self) -> list[Cores]:
        """``device_map.model`` of the models (equal with ``shared_replicas``): the cores of the group's replicas."""
        return self.models[0].model_cores()
