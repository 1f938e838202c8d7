"""The project's DLRM (``disagg.model.DLRM``, preset ``tiny``) served as a user model.

Factory ``disagg.examples.dlrm:build``; signature (the presets' own, ``disagg.signature.dlrm_signature(13, 26)``):

- input ``dense_features`` FP32 [-1, 13], argument ``dense``;
- input ``sparse_features`` INT64 [-1, 26, -1], argument ``sparse``: a bag of ids per table (1000 rows or fewer),
  summed, -1 an empty slot (``pad_value: -1``);
- output ``probabilities`` FP32 [-1, 1].

With ``weights:`` the shipped ``disagg/weights/tiny/model.safetensors`` (as an absolute path) it serves what the
``tiny`` preset serves. Without, it has the preset's seed-0 initialisation: the DLRM seeds each layer itself, so
``model.seed`` does not change it.
"""

from __future__ import annotations

from disagg.model import DLRM
from disagg.spec import preset_spec


def build() -> DLRM:
    """The ``tiny`` DLRM with its seed-0 per-layer initialisation."""
    return DLRM(preset_spec("tiny"))
