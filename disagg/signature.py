"""A served model's input and output tensors as the OIP v2 API names them (pydantic and the standard library only).

Each input is one argument of the model's ``forward``; dimension 0 of every tensor is the batch (-1), other
dimensions are fixed or -1 (variable per request, e.g. ids per bag or history length). The DLRM presets have the
signature ``dlrm_signature`` gives; a user model's comes from its config (``model.inputs`` / ``model.outputs``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: OIP v2 element types.
Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]  # fmt: skip
#: Element types a model input may declare; a request may send an integer input as INT32 or INT64.
InputDatatype = Literal["BOOL", "INT32", "INT64", "FP16", "FP32", "FP64"]
INTEGER_DATATYPES = ("INT32", "INT64")
FLOAT_DATATYPES = ("FP16", "FP32", "FP64")
#: The batch dimension, first in every shape; other -1 dimensions vary per request.
VARIABLE = -1
_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$"


def _check_shape(shape: list[int]) -> list[int]:
    if not shape or shape[0] != VARIABLE:
        raise ValueError(f"must start with -1, the batch dimension, got {shape}")
    if any(size != VARIABLE and size < 1 for size in shape):
        raise ValueError(f"dimensions are -1 (variable) or positive, got {shape}")
    if len(shape) > 8:
        raise ValueError(f"at most 8 dimensions, got {len(shape)}")
    return shape


class InputSignature(BaseModel):
    """One model input: its wire name, element type and shape, and the ``forward`` argument it feeds."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=_NAME, description="Tensor name on the wire (`inputs[].name`).")
    datatype: InputDatatype = Field(description="Element type; an INT64 input also takes INT32 data.")
    shape: list[int] = Field(description="Dimensions: -1 first (the batch), then fixed sizes or -1 (variable).")
    argument: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="The `forward` argument it feeds; default: `name`.",
    )
    pad_value: float | None = Field(
        None, description="Requests whose variable dimensions differ are padded with this value to share a forward "
        "pass (the DLRM's -1 empty id slots); unset: such requests run in separate passes of one batch.",
    )

    @field_validator("shape")
    @classmethod
    def _shape(cls, shape: list[int]) -> list[int]:
        return _check_shape(shape)

    @property
    def forward_argument(self) -> str:
        return self.argument or self.name

    @model_validator(mode="after")
    def _pad_fits(self) -> InputSignature:
        if self.pad_value is not None and self.datatype in (*INTEGER_DATATYPES, "BOOL") and \
                self.pad_value != int(self.pad_value):
            raise ValueError(f"pad_value of an {self.datatype} input must be a whole number, got {self.pad_value}")
        return self


class OutputSignature(BaseModel):
    """One model output: its wire name, element type and shape."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=_NAME, description="Tensor name on the wire (`outputs[].name`).")
    datatype: InputDatatype = Field("FP32", description="Element type it is sent as.")
    shape: list[int] = Field([VARIABLE, VARIABLE], description="Dimensions: -1 first (the batch), then fixed "
                             "sizes or -1.")

    @field_validator("shape")
    @classmethod
    def _shape(cls, shape: list[int]) -> list[int]:
        return _check_shape(shape)


def _unique(kind: str, names: list[str]) -> None:
    if duplicates := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"{kind}: duplicate name {duplicates[0]!r}")


class ModelSignature(BaseModel):
    """Inputs (one per ``forward`` argument they feed) and outputs (in the order ``forward`` returns them: one
    tensor, a tuple or list, or a dict keyed by output name)."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[InputSignature] = Field(min_length=1, max_length=64)
    outputs: list[OutputSignature] = Field(default_factory=lambda: [OutputSignature(name="output")], min_length=1,
                                           max_length=64)

    @model_validator(mode="after")
    def _names_unique(self) -> ModelSignature:
        _unique("inputs", [tensor.name for tensor in self.inputs])
        _unique("inputs", [tensor.forward_argument for tensor in self.inputs])
        _unique("outputs", [tensor.name for tensor in self.outputs])
        return self

    def input(self, name: str) -> InputSignature:
        return next(tensor for tensor in self.inputs if tensor.name == name)


#: Wire names of the DLRM presets' tensors.
DENSE_INPUT = "dense_features"
SPARSE_INPUT = "sparse_features"
PROBABILITIES_OUTPUT = "probabilities"
#: Marks an unused id slot in a ``sparse_features`` bag.
EMPTY_SLOT = -1


def dlrm_signature(num_dense: int, num_tables: int) -> ModelSignature:
    """The DLRM presets' signature: ``dense_features`` [B, num_dense] FP32, ``sparse_features`` [B, T, ids]
    (padded with empty slots), ``probabilities`` [B, 1]."""
    return ModelSignature(
        inputs=[
            InputSignature(name=DENSE_INPUT, datatype="FP32", shape=[VARIABLE, num_dense], argument="dense"),
            InputSignature(name=SPARSE_INPUT, datatype="INT64", shape=[VARIABLE, num_tables, VARIABLE],
                           argument="sparse", pad_value=EMPTY_SLOT),
        ],
        outputs=[OutputSignature(name=PROBABILITIES_OUTPUT, datatype="FP32", shape=[VARIABLE, 1])],
    )
