"""Configuration of the DLRM serving applications, one model per concern.

``DLRMAppConfig`` is what a Ray Serve config file passes as ``args`` to ``disagg.app:build_app``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from disagg.signature import InputSignature, ModelSignature, OutputSignature, dlrm_signature
from disagg.spec import PRESETS, preset_spec, preset_weights

if TYPE_CHECKING:
    from disagg.tables import TableLayout

#: How a shard stores a table: as is, half precision, or 8-bit row-wise (uint8 + fp16 scale and bias per row).
StorageDtype = Literal["float32", "float16", "int8"]
#: Element type of the rows on the wire.
WireDtype = Literal["float32", "float16", "bfloat16"]
MiB = 1024 * 1024


#: ``package.module:function`` or ``/absolute/path/file.py:function``.
FACTORY_PATTERN = r"^(/[^:]+\.py|[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*):[A-Za-z_][A-Za-z0-9_]*$"


class DLRMModelConfig(BaseModel):
    """Which model to build and where to run it: a DLRM preset, or a user model from a factory with its signature."""

    model_config = ConfigDict(extra="forbid")

    preset: str | None = Field(
        None, description=f"DLRM architecture preset, one of: {', '.join(sorted(PRESETS))}; default `tiny` unless a "
        "`factory` is given.",
    )
    factory: str | None = Field(
        None, pattern=FACTORY_PATTERN,
        description="A user model instead of a preset: `package.module:function` or `/absolute/path/file.py:function`, "
        "a function of no arguments returning the `nn.Module` (importable wherever a replica runs); needs `inputs`.",
    )
    inputs: list[InputSignature] | None = Field(
        None, min_length=1, max_length=64,
        description="The factory model's inputs, one per `forward` argument: `{name, datatype, shape}` (OIP v2 "
        "datatypes, -1 first for the batch, -1 for a variable dimension), optional `argument` (the forward "
        "argument, default `name`) and `pad_value`.",
    )
    outputs: list[OutputSignature] | None = Field(
        None, min_length=1, max_length=64,
        description="The factory model's outputs in the order `forward` returns them (`{name, datatype, shape}`); "
        "default one FP32 `output`.",
    )
    seed: int = Field(0, ge=0, description="Seed of the deterministic weight initialisation (when no trained "
                      "weights are loaded): the preset's per-layer initialisation, or the torch seed a factory runs "
                      "under.")
    weights: str = Field(
        "auto",
        min_length=1,
        description="Trained weights: `auto` = the preset's shipped weights where it has some (`tiny`: trained on "
        "synthetic click logs, disagg/weights/tiny/), else the seeded initialisation; `seeded` = always the "
        "seeded initialisation from `seed`; or the absolute path of a `.safetensors` file holding the model's state "
        "dict (readable wherever a replica runs; each shard reads only its own tables from it).",
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
    stacked_tables: bool = Field(
        True, description="Monolithic replicas hold the tables of one row width in one tensor and pool every bag "
        "of a batch in one embedding_bag call (as FBGEMM's table-batched embeddings do); false runs the model's "
        "own modules one table at a time. The outputs are equal either way."
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, preset: str | None) -> str | None:
        if preset is not None and preset not in PRESETS:
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

    @model_validator(mode="after")
    def _preset_or_factory(self) -> DLRMModelConfig:
        if self.factory is None:
            if self.inputs is not None or self.outputs is not None:
                raise ValueError("inputs and outputs describe a `factory` model; a preset has its own signature")
            if self.preset is None:
                self.preset = "tiny"
            return self
        if self.preset is not None:
            raise ValueError("give `preset` or `factory`, not both")
        if self.inputs is None:
            raise ValueError("a `factory` model needs `inputs`: one {name, datatype, shape} per forward argument")
        ModelSignature(inputs=self.inputs, **({} if self.outputs is None else {"outputs": self.outputs}))
        return self

    @property
    def label(self) -> str:
        """What is served, for logs: the preset's name or the factory."""
        return self.factory or str(self.preset)

    def signature(self) -> ModelSignature:
        """The served tensors: the config's own for a factory model, else the DLRM presets' (``dlrm_signature``)."""
        if self.factory is None:
            spec = preset_spec(str(self.preset))
            return dlrm_signature(spec.num_dense, spec.num_tables)
        assert self.inputs is not None  # _preset_or_factory
        return ModelSignature(inputs=self.inputs, **({} if self.outputs is None else {"outputs": self.outputs}))

    def weights_path(self) -> Path | None:
        """The safetensors file to load the model from, or None for the seeded initialisation from ``seed``."""
        if self.weights == "seeded":
            return None
        if self.weights == "auto":
            return None if self.factory is not None else preset_weights(str(self.preset))
        return Path(self.weights)


class DLRMLimits(BaseModel):
    """Per-request limits; requests beyond them are refused with 4xx before reaching the model."""

    model_config = ConfigDict(extra="forbid")

    max_rows_per_request: int = Field(4096, ge=1, description="Most rows (samples) in one infer request.")
    max_ids_per_feature: int = Field(
        64, ge=1, description="Largest size of an input's variable dimension other than the batch: ids per table in "
        "one row of the presets' `sparse_features` (H of a [B, T, H] multi-hot bag), a user model's history length."
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


class EmbeddingCacheConfig(BaseModel):
    """The hot-embedding cache of each dense replica: rows of recently (LRU) or frequently (LFU) used ids, so their
    lookups skip the RPC. Set-associative; dropped for a table when its shard reports another table version."""

    model_config = ConfigDict(extra="forbid")

    max_bytes: int = Field(
        0, ge=0, le=2**40, description="Bytes of cached rows (with their tags) per dense replica, shared among the "
        "tables in proportion to their sizes; 0 turns the cache off."
    )
    policy: Literal["lru", "lfu"] = Field("lru", description="Eviction within a set: least recently or least "
                                          "frequently used.")
    ways: int = Field(8, ge=1, le=64, description="Entries per set: an id can live in any of its set's ways.")


class EmbeddingServiceConfig(BaseModel):
    """The embedding shards of a disaggregated DLRM: gRPC servers, one Serve deployment per shard (placed by the
    Serve config's `ray_actor_options.resources`). Access, TLS and the shared token: docs/DEPLOYMENT.md, "Exposing
    the embedding service"; the TLS files are read (``disagg.rpc.tls``) when a replica starts."""

    model_config = ConfigDict(extra="forbid")

    num_shards: int = Field(2, ge=1, le=64, description="Embedding tables are split table-wise over this many shards.")
    replicas_per_shard: int = Field(1, ge=1, le=64, description="gRPC server replicas of each shard.")
    bind_host: str = Field(
        "node",
        pattern=r"^(node|[0-9A-Za-z.:-]+)$",
        description="Address shard servers bind: `node` = the Ray node's IP address (the private address the "
        "cluster already uses), or an explicit address such as `127.0.0.1`. One that is neither loopback nor private "
        "(RFC 1918, ULA), such as `0.0.0.0` or a public IP, needs TLS or SWIFTSERVE_EMBEDDING_TOKEN.",
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
    row_wise_min_bytes: int | None = Field(
        256 * MiB, ge=1, description="A table with more float32 bytes than this is split by id range over every "
        "shard (pooled bags stay exact: rows are pooled on the dense side); null: tables are never split."
    )
    storage_dtype: StorageDtype = Field(
        "float32", description="How shards store tables: `float32`, `float16`, or `int8` (row-wise, uint8 values "
        "with a float16 scale and bias per row, as FBGEMM's inference tables); quantized tables change the "
        "predictions slightly (docs/DEPLOYMENT.md gives the measured AUC change)."
    )
    table_storage: dict[str, StorageDtype] = Field(
        default_factory=dict, description="Per-table override of `storage_dtype`, by table name (`embeddings.3`)."
    )
    transport: Literal["stream", "call"] = Field(
        "stream", description="How dense replicas send lookups: `stream` (messages on one long-lived LookupStream "
        "call per shard replica: the least CPU and latency per lookup) or `call` (one Lookup call each)."
    )
    wire_dtype: WireDtype = Field(
        "float32", description="Element type of the rows shards send back: `float32` (bit-equal to monolithic "
        "serving), or `float16`/`bfloat16` (half the bytes, rounded)."
    )
    cache: EmbeddingCacheConfig = Field(
        default_factory=EmbeddingCacheConfig, description="Hot-embedding cache of each dense replica."
    )
    tls_cert_file: str | None = Field(
        None, description="Absolute path of the PEM certificate chain shard servers present; set it with "
        "`tls_key_file` and `tls_ca_file` to serve TLS (none of the three: plaintext). With `tls_client_auth`, dense "
        "replicas present it as their client certificate too (its extended key usage must then allow both)."
    )
    tls_key_file: str | None = Field(None, description="Absolute path of the PEM private key of `tls_cert_file`.")
    tls_ca_file: str | None = Field(
        None, description="Absolute path of the PEM CA certificates dense replicas trust to have signed the shard "
        "servers' certificates (with `tls_client_auth`, shard servers trust them for client certificates too)."
    )
    tls_client_auth: bool = Field(
        False, description="Mutual TLS: shard servers refuse clients without a certificate signed by `tls_ca_file`."
    )
    tls_server_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$",
        description="Name dense replicas verify in shard servers' certificates instead of the IP they dial, so one "
        "certificate (e.g. with subject alternative name `embedding.internal`) serves every node; default: the IP.",
    )

    @field_validator("tls_cert_file", "tls_key_file", "tls_ca_file")
    @classmethod
    def _absolute_path(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).is_absolute():
            raise ValueError(f"must be an absolute path (readable wherever a replica runs), got {path!r}")
        return path

    @model_validator(mode="after")
    def _tls_complete(self) -> EmbeddingServiceConfig:
        files = {"tls_cert_file": self.tls_cert_file, "tls_key_file": self.tls_key_file,
                 "tls_ca_file": self.tls_ca_file}
        if None in files.values() and any(files.values()):
            missing = ", ".join(name for name, path in files.items() if path is None)
            raise ValueError(f"TLS needs tls_cert_file, tls_key_file and tls_ca_file together; missing: {missing}")
        if self.tls_cert_file is None and (self.tls_client_auth or self.tls_server_name is not None):
            raise ValueError("tls_client_auth and tls_server_name need TLS: set tls_cert_file, tls_key_file and "
                             "tls_ca_file")
        return self

    @property
    def tls(self) -> bool:
        """Whether shard servers serve TLS."""
        return self.tls_cert_file is not None

    def layout(self) -> TableLayout:
        """How the tables are cut into shards and stored (imports torch)."""
        from disagg.tables import TableLayout

        return TableLayout(self.num_shards, row_wise_min_bytes=self.row_wise_min_bytes,
                           storage_dtype=self.storage_dtype, table_storage=dict(self.table_storage))


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

    @model_validator(mode="after")
    def _known_tables(self) -> DLRMAppConfig:
        if self.model.factory is not None:  # its tables are known once it is built: checked by check_model
            return self
        tables = [f"embeddings.{index}" for index in range(preset_spec(self.model.preset).num_tables)]
        if unknown := sorted(set(self.embedding.table_storage) - set(tables)):
            raise ValueError(f"embedding.table_storage: unknown table {unknown[0]!r}; the {self.model.preset} preset "
                             f"has tables embeddings.0 to embeddings.{len(tables) - 1}")
        return self
