"""Configuration of the DLRM serving applications, one model per concern.

``DLRMAppConfig`` is what a Ray Serve config file passes as ``args`` to ``disagg.app:build_app``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from disagg.model import PRESETS, preset_weights


class DLRMModelConfig(BaseModel):
    """Which DLRM to build and where to run it."""

    model_config = ConfigDict(extra="forbid")

    preset: str = Field(
        "tiny", description=f"DLRM architecture preset, one of: {', '.join(sorted(PRESETS))}."
    )
    seed: int = Field(0, ge=0, description="Seed of the deterministic weight initialisation (when no trained "
                      "weights are loaded).")
    weights: str = Field(
        "auto",
        min_length=1,
        description="Trained weights: `auto` = the preset's shipped weights where it has some (`tiny`: trained on "
        "synthetic click logs, disagg/weights/tiny/), else the seeded initialisation; `seeded` = always the "
        "seeded initialisation from `seed`; or the absolute path of a `.safetensors` file holding the preset's state "
        "dict (readable wherever a replica runs).",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Torch device: `auto` (SWIFTSERVE_DEVICE if set, else CUDA when present, else CPU), "
        "`cpu`, `cuda` or `cuda:N`.",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads of a replica running the dense part (or the whole model); "
        "default: torch's (Ray sets it from the replica's `num_cpus`)."
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, preset: str) -> str:
        if preset not in PRESETS:
            raise ValueError(f"unknown DLRM preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}")
        return preset

    @field_validator("weights")
    @classmethod
    def _weights_file(cls, weights: str) -> str:
        if weights not in ("auto", "seeded") and not (weights.endswith(".safetensors") and Path(weights).is_absolute()):
            raise ValueError(
                f"weights must be `auto`, `seeded` or an absolute path ending in .safetensors, got {weights!r}"
            )
        return weights

    def weights_path(self) -> Path | None:
        """The safetensors file to load the model from, or None for the seeded initialisation from ``seed``."""
        if self.weights == "seeded":
            return None
        if self.weights == "auto":
            return preset_weights(self.preset)
        return Path(self.weights)


class DLRMLimits(BaseModel):
    """Per-request limits; requests beyond them are refused with 4xx before reaching the model."""

    model_config = ConfigDict(extra="forbid")

    max_rows_per_request: int = Field(4096, ge=1, description="Most rows (samples) in one infer request.")
    max_ids_per_feature: int = Field(
        64, ge=1, description="Most ids per table in one row of `sparse_features` (H of a [B, T, H] multi-hot bag)."
    )
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest request body in bytes; larger ones get 413."
    )


class BatchingConfig(BaseModel):
    """Dynamic batching across concurrent requests (Ray Serve ``@serve.batch``)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(64, ge=1, description="Most requests merged into one forward pass.")
    batch_wait_timeout_s: float = Field(
        0.005, ge=0.0, le=10.0, description="Seconds the first request of a batch waits for others to join."
    )


class EmbeddingServiceConfig(BaseModel):
    """The embedding shards of a disaggregated DLRM: gRPC servers, one Serve deployment per shard.

    Where shard replicas run is Serve's business: give the `EmbeddingShard_<i>` deployments
    `ray_actor_options.resources` (e.g. a custom resource that only CPU nodes have) in the Serve config.
    """

    model_config = ConfigDict(extra="forbid")

    num_shards: int = Field(2, ge=1, le=64, description="Embedding tables are split table-wise over this many shards.")
    replicas_per_shard: int = Field(1, ge=1, le=64, description="gRPC server replicas of each shard.")
    bind_host: str = Field(
        "node",
        pattern=r"^(node|[0-9A-Za-z.:-]+)$",
        description="Address shard servers bind: `node` = the Ray node's IP address (the private address the "
        "cluster already uses), or an explicit address such as `127.0.0.1`.",
    )
    lookup_timeout_s: float = Field(
        2.0, gt=0.0, le=60.0, description="Deadline of one batch's embedding lookup, replica failovers included; "
        "past it the batch's requests get 503."
    )
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=1024 * 1024, le=2**31 - 1,
        description="gRPC message size limit on both sides; larger lookups are split into chunks below it.",
    )
    discovery_period_s: float = Field(
        1.0, gt=0.0, le=60.0, description="Shard replicas re-announce their address and dense replicas refresh "
        "theirs this often; an address not announced for 3 periods is dropped."
    )
    startup_timeout_s: float = Field(
        300.0, ge=0.0, le=3600.0, description="A starting dense replica waits this long for every shard to announce a "
        "replica (shards load their tables meanwhile) before it starts anyway, not ready until they do."
    )
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads of a shard replica.")


class DLRMAppConfig(BaseModel):
    """A DLRM inference application: model, serving layout, request limits and batching."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field(
        "dlrm",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="Name in the OIP routes (`/v2/models/{model_name}/infer`): up to 64 letters, digits, "
        "`_`, `.` or `-`, starting with a letter or digit.",
    )
    model: DLRMModelConfig = Field(default_factory=DLRMModelConfig, description="The model to serve.")
    serving: Literal["disaggregated", "monolithic"] = Field(
        "disaggregated",
        description="`disaggregated`: embedding shards (gRPC, CPU) and dense replicas (CUDA when present) as "
        "separate deployments; `monolithic`: the whole model in each replica.",
    )
    embedding: EmbeddingServiceConfig = Field(
        default_factory=EmbeddingServiceConfig, description="Embedding shards (disaggregated serving only)."
    )
    limits: DLRMLimits = Field(default_factory=DLRMLimits, description="Per-request limits.")
    batching: BatchingConfig = Field(default_factory=BatchingConfig, description="Dynamic batching.")
