"""Hostile files, images and names: each is refused with its module's own error naming the file or field (a 4xx
over HTTP), before any work or memory proportional to its lie, and nothing shared changes.

* LoRA safetensors files whose headers lie (``serving.lora.format``): ``LoRAFormatError`` -> 422;
* conditioning images that are decompression, chunk or scan bombs (``serving.controlnet.conditioning``):
  ``ConditioningImageError`` -> 400 naming ``controlnets[i].image``;
* names that would become paths (LoRAs, ControlNets, presets, DLRM and bank names): refused by name, never
  resolved outside their directory (a canary file outside is never opened);
* afterwards the LoRA directory, the shipped weights and the engine's parameters hash the same.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import struct
import sys
import threading
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import cv2
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import ValidationError

import disagg.model as dlrm_model
import serving.lora.format as lora_format
from autoconfig.bank import ModelDescription
from disagg.config import DLRMAppConfig, DLRMModelConfig
from disagg.model import build_preset as build_dlrm
from disagg.spec import preset_weights as dlrm_preset_weights
from serving.config import ControlNetConfig, DiffusionModelConfig, LoRAConfig
from serving.controlnet.conditioning import MAX_JPEG_SCANS, MAX_SEGMENTS, ConditioningImageError, decode_image
from serving.controlnet.models import build_controlnet_preset, controlnet_preset_weights, load_controlnet
from serving.lora import InvalidLoRAName, LoRAFormatError, LoRANotFound, LoRARegistry, load_lora_file
from serving.preset_catalog import WEIGHTS_ROOT, preset_weights
from serving.presets import build_preset, load_local
from tests.helpers import REPO
from tests.helpers.images import encode_b64, grey_png, png_chunk, progressive_jpeg, square
from tests.helpers.images_api import images_client
from tests.helpers.lora_files import safetensors_bytes, write_lora

SHIPPED_WEIGHTS = (REPO / "serving" / "weights" / "tiny", REPO / "disagg" / "weights" / "tiny")
MODULE = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k"  # Linear(64, 64) in the tiny UNet
DOWN, UP = f"unet.{MODULE}.lora_A.weight", f"unet.{MODULE}.lora_B.weight"
#: Python allocations a refusal may make: the lies below claim 2**63-byte headers, 2**82-byte tensors, a million
#: tensors (430 MB of parsed header), 10**10-pixel images.
REFUSAL_BYTES = 32 * 2**20
API_MAX_FILE_BYTES = 64 * 2**20


# --- what was opened ---------------------------------------------------------------------------------------------


class OpenedFiles:
    """Paths Python code opens (``open`` audit events: ``open()``, ``os.open``) while recording."""

    def __init__(self) -> None:
        self._paths: list[str] | None = None

    def __call__(self, event: str, args: tuple) -> None:
        if event == "open" and self._paths is not None and isinstance(args[0], str | bytes | os.PathLike):
            self._paths.append(os.fsdecode(args[0]))

    @contextmanager
    def recording(self) -> Iterator[list[str]]:
        self._paths = paths = []
        try:
            yield paths
        finally:
            self._paths = None


@pytest.fixture(scope="session")
def opened_files() -> OpenedFiles:
    recorder = OpenedFiles()
    sys.addaudithook(recorder)  # audit hooks cannot be removed; it records only inside `recording()`
    return recorder


def opens_of(paths: list[str], target: Path) -> list[str]:
    return [path for path in paths if Path(path).resolve() == target.resolve()]


def test_opened_files_sees_opens_from_any_thread(opened_files, tmp_path):
    canary = tmp_path / "canary"
    canary.write_bytes(b"x")
    with opened_files.recording() as opened:
        thread = threading.Thread(target=canary.read_bytes)
        thread.start()
        thread.join()
        os.close(os.open(canary, os.O_RDONLY))
    assert len(opens_of(opened, canary)) == 2


# --- hostile LoRA files ------------------------------------------------------------------------------------------


class Lie(NamedTuple):
    """A hand-built safetensors file and what its refusal must say."""

    content: Callable[[], bytes]
    match: str
    unparsed: bool  # refused before safetensors parses anything


def _tensor(dtype: str, shape: list[int], start: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def _empty_tensors(count: int) -> bytes:
    """A header listing ``count`` empty tensors (about 50 bytes each)."""
    return b"{" + b",".join(b'"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i for i in range(count)) + b"}"


def _factors(dtype: str, down_shape: list[int], up_shape: list[int], nbytes: int) -> bytes:
    """The tiny UNet's ``to_k`` LoRA factors in ``dtype``, ``nbytes`` each, all bits set."""
    header = {DOWN: _tensor(dtype, down_shape, 0, nbytes), UP: _tensor(dtype, up_shape, nbytes, 2 * nbytes)}
    return safetensors_bytes(header, b"\xff" * (2 * nbytes))


LIES: dict[str, Lie] = {
    # the declared header length
    "shorter-than-a-header": Lie(lambda: b"\x01\x00", "shorter than a header", True),
    "header-past-the-end": Lie(lambda: safetensors_bytes({DOWN: _tensor("F32", [1], 0, 4)}, bytes(4),
                                                         header_length=10**6),
                               r"header length 1000000 runs past the end of the \d+-byte file", True),
    "header-length-2e63": Lie(lambda: safetensors_bytes({}, header_length=2**63 - 1), "runs past the end", True),
    "header-length-2e64": Lie(lambda: safetensors_bytes({}, header_length=2**64 - 1), "runs past the end", True),
    "header-over-the-limit": Lie(lambda: safetensors_bytes({"__metadata__": {"notes": "x" * 9 * 2**20}}),
                                 r"header is 94372\d\d bytes, over the 8388608-byte limit", True),
    "a-million-tensors": Lie(lambda: safetensors_bytes(_empty_tensors(10**6)), "over the 8388608-byte limit", True),
    "100k-tensors": Lie(lambda: safetensors_bytes(_empty_tensors(100_000)), "lists more than 16384 tensors", True),
    # a header that is not a JSON object
    "header-not-utf8": Lie(lambda: safetensors_bytes(b'{"\xff": 1}'), "header is not a JSON object", True),
    "header-a-list": Lie(lambda: safetensors_bytes(b"[]"), "header is not a JSON object", True),
    "header-nested-deeply": Lie(lambda: safetensors_bytes(b'{"a":' + b"[" * 10**5 + b"]" * 10**5 + b"}"),
                                "header is not a JSON object: maximum recursion depth", True),
    # valid JSON that lies about the data
    "offsets-past-the-end": Lie(lambda: safetensors_bytes({DOWN: _tensor("F32", [4, 64], 0, 1024)}, bytes(16)),
                                "not a valid safetensors file: .*incomplete metadata", False),
    "overlapping-offsets": Lie(lambda: safetensors_bytes({DOWN: _tensor("F32", [2], 0, 8),
                                                          UP: _tensor("F32", [2], 4, 12)}, bytes(12)),
                               "not a valid safetensors file: .*invalid offset", False),
    "gap-before-the-data": Lie(lambda: safetensors_bytes({DOWN: _tensor("F32", [1], 4, 8)}, bytes(8)),
                               "not a valid safetensors file: .*invalid offset", False),
    "offsets-disagree-with-shape": Lie(lambda: safetensors_bytes({DOWN: _tensor("F32", [3], 0, 4)}, bytes(4)),
                                       "not a valid safetensors file: .*invalid shape, data type, or offset", False),
    "shape-2e40-squared": Lie(lambda: safetensors_bytes({DOWN: _tensor("F32", [2**40, 2**40], 0, 4)}, bytes(4)),
                              "not a valid safetensors file: .*overflow", False),
    "shape-negative": Lie(lambda: safetensors_bytes({DOWN: _tensor("F32", [-1], 0, 4)}, bytes(4)),
                          "not a valid safetensors file: .*integer `-1`", False),
    "offset-negative": Lie(lambda: safetensors_bytes({DOWN: _tensor("F32", [1], -4, 0)}, bytes(4)),
                           "not a valid safetensors file: .*integer `-4`", False),
    "dtype-unknown": Lie(lambda: safetensors_bytes({DOWN: _tensor("Q7", [1], 0, 4)}, bytes(4)),
                         "not a valid safetensors file: .*unknown variant `Q7`", False),
    "metadata-not-strings": Lie(lambda: safetensors_bytes({"__metadata__": {"r": 4}}),
                                "not a valid safetensors file", False),
    # valid safetensors that lies about being a LoRA
    "zero-size-2e40-factors": Lie(lambda: safetensors_bytes({DOWN: _tensor("F32", [2**40, 0], 0, 0),
                                                             UP: _tensor("F32", [0, 2**40], 0, 0)}),
                                  r"shape \(1099511627776, 0\) does not fit Linear\(64, 64\)", False),
    "float4-factors": Lie(lambda: _factors("F4", [4, 128], [64, 8], 256),  # packed: torch shapes (4, 64), (64, 4)
                          "float4_e2m1fn_x2 is not a LoRA weight dtype", False),
    "exponent-only-float8": Lie(lambda: _factors("F8_E8M0", [4, 64], [64, 4], 256),
                                "float8_e8m0fnu is not a LoRA weight dtype", False),
}


def write_lie(directory: Path, name: str) -> Path:
    path = directory / f"{name}.safetensors"
    path.write_bytes(LIES[name].content())
    return path


@pytest.fixture
def no_safetensors_parse(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("safetensors parsed the file")
    monkeypatch.setattr(lora_format, "safe_open", refuse)


@contextmanager
def python_peak_bytes() -> Iterator[list[int]]:
    """The peak of Python allocations inside the block (``[peak]`` once it ends)."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


@pytest.mark.parametrize("name", LIES)
def test_lying_lora_file_is_refused_naming_it_without_work_in_proportion(name, tiny_engine, tmp_path, request):
    path = write_lie(tmp_path, name)
    if LIES[name].unparsed:
        request.getfixturevalue("no_safetensors_parse")
    with python_peak_bytes() as peak, pytest.raises(LoRAFormatError) as refused:
        load_lora_file(path, tiny_engine.lora_targets, max_file_bytes=2**30)
    assert refused.value.name == path.name and str(refused.value).startswith(f"{path.name}: ")
    assert re.search(LIES[name].match, refused.value.reason), refused.value.reason
    assert peak[0] < REFUSAL_BYTES


def test_tensor_and_header_caps_are_the_configured_ones(tiny_engine, tmp_path, no_safetensors_parse):
    many = write_lie(tmp_path, "100k-tensors")
    with pytest.raises(LoRAFormatError, match="lists more than 99999 tensors"):
        load_lora_file(many, tiny_engine.lora_targets, max_file_bytes=2**30, max_tensors=99_999)
    with pytest.raises(LoRAFormatError, match=r"header is \d+ bytes, over the 1000000-byte limit"):
        load_lora_file(many, tiny_engine.lora_targets, max_file_bytes=2**30, max_header_bytes=10**6)
    assert LoRAConfig().max_tensors == 16384 and LoRAConfig().max_header_bytes == 8 * 2**20
    for field, value in (("max_tensors", 0), ("max_header_bytes", 1)):
        with pytest.raises(ValidationError, match=field):
            LoRAConfig(**{field: value})


def test_file_over_max_file_bytes_is_refused_unread(tiny_engine, tmp_path, no_safetensors_parse):
    path = tmp_path / "sparse.safetensors"
    with path.open("wb") as file:
        file.truncate(8 * 2**30)  # sparse: 8 GiB that take no disk
    with pytest.raises(LoRAFormatError, match="file is 8589934592 bytes, over the 1073741824-byte limit"):
        load_lora_file(path, tiny_engine.lora_targets, max_file_bytes=2**30)


def test_fifo_is_refused_without_blocking(tiny_engine, tmp_path, no_safetensors_parse):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with pytest.raises(LoRAFormatError, match=r"pipe\.safetensors: not a regular file"):
        load_lora_file(fifo, tiny_engine.lora_targets, max_file_bytes=2**30)


def _reversed_layout(raw: bytes) -> bytes:
    """The same safetensors file with its tensors' bytes stored in the opposite order (offsets rewritten)."""
    (length,) = struct.unpack_from("<Q", raw)
    header, data = json.loads(raw[8:8 + length]), raw[8 + length:]
    entries = sorted((key for key in header if key != "__metadata__"), key=lambda key: header[key]["data_offsets"])
    chunks, offset = [], 0
    for key in reversed(entries):
        start, end = header[key]["data_offsets"]
        chunks.append(data[start:end])
        header[key]["data_offsets"] = [offset, offset + end - start]
        offset += end - start
    return safetensors_bytes(header, b"".join(chunks))


def test_offsets_in_another_order_than_the_keys_are_honoured_not_refused(tiny_engine, tmp_path):
    original = write_lora(tmp_path / "original.safetensors", seed=2, text_encoder=True)
    reordered = tmp_path / "reordered.safetensors"
    reordered.write_bytes(_reversed_layout(original.read_bytes()))
    assert reordered.read_bytes() != original.read_bytes()
    want, got = (load_lora_file(path, tiny_engine.lora_targets, max_file_bytes=2**30) for path in (original, reordered))
    assert want.denoiser.keys() == got.denoiser.keys() and want.text_encoder.keys() == got.text_encoder.keys()
    for module, layer in [*want.denoiser.items(), *want.text_encoder.items()]:
        other = got.denoiser.get(module) or got.text_encoder[module]
        assert torch.equal(layer.down, other.down) and torch.equal(layer.up, other.up) and layer.scale == other.scale


# --- hostile names -----------------------------------------------------------------------------------------------

CANARY = "secret"  # <root>/outside/secret.safetensors, beside the LoRA directory <root>/loras
HOSTILE_NAMES = [
    "../outside/secret", "{outside}", "..\\outside\\secret", "..", "secret\x00", "secret\x00.bin",
    "%2e%2e%2foutside%2fsecret", "..%2foutside%2fsecret", "\uff0e\uff0e\uff0foutside\uff0fsecret",  # fullwidth ../
    "\u2025/outside/secret", "outside\u2215secret", "\u0455ecret",  # two-dot leader, division slash, Cyrillic s
    "secret\n", "secret ", "C:secret", "~", "good/../good", "good.safetensors/..", "x" * 129, "x" * 100_000,
]


def hostile_name(template: str, root: Path) -> str:
    return template.replace("{outside}", str(root / "outside" / CANARY))


@pytest.fixture
def lora_root(tmp_path) -> Path:
    """<tmp>/loras with good.safetensors, a canary <tmp>/outside/secret.safetensors and links escaping to it."""
    (tmp_path / "loras").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / f"{CANARY}.safetensors").write_bytes(b"canary")
    (tmp_path / "loras" / "good.safetensors").write_bytes(b"x")
    (tmp_path / "loras" / "escape.safetensors").symlink_to(tmp_path / "outside" / f"{CANARY}.safetensors")
    (tmp_path / "loras" / "relative-escape.safetensors").symlink_to(Path("..") / "outside" / f"{CANARY}.safetensors")
    (tmp_path / "loras" / "dir-escape.safetensors").symlink_to(tmp_path / "outside", target_is_directory=True)
    return tmp_path


@pytest.mark.parametrize("template", HOSTILE_NAMES)
def test_hostile_lora_names_are_refused_by_name_before_any_file_access(template, lora_root, monkeypatch):
    name = hostile_name(template, lora_root)
    registry = LoRARegistry(lora_root / "loras")
    monkeypatch.setattr(Path, "resolve", lambda *args, **kwargs: pytest.fail("the name reached the file system"))
    with pytest.raises(InvalidLoRAName) as refused:
        registry.resolve(name)
    assert refused.value.name == name


@pytest.mark.parametrize("name", ["escape", "relative-escape", "dir-escape"])
def test_links_out_of_the_lora_directory_are_not_found(name, lora_root, opened_files):
    registry = LoRARegistry(lora_root / "loras")
    with opened_files.recording() as opened, pytest.raises(LoRANotFound) as refused:
        registry.resolve(name)
    assert refused.value.name == name and name not in registry.names()
    assert not opens_of(opened, lora_root / "outside" / f"{CANARY}.safetensors")


@pytest.mark.parametrize("name", ["../tiny", "/tiny", "tiny/..", "tiny/../../..", "..", "TINY", "tiny\x00"])
def test_preset_names_are_never_joined_to_a_path(name):
    for lookup in (build_preset, preset_weights, build_controlnet_preset, controlnet_preset_weights):
        with pytest.raises(ValueError, match=r"unknown .*preset"):
            lookup(name)
    with pytest.raises(ValidationError, match="unknown preset"):
        DiffusionModelConfig(preset=name)
    with pytest.raises(ValidationError, match="unknown preset"):
        ControlNetConfig(name="edges", preset=name)
    with pytest.raises(ValueError, match="unknown DLRM preset"):
        dlrm_preset_weights(name)
    with pytest.raises(ValidationError, match="preset"):
        DLRMModelConfig(preset=name)


@pytest.mark.parametrize("name", ["../x", "/x", "a/b", "a\\b", ".x", "x\x00", "x\n", "\uff0e\uff0e", "x" * 129])
def test_names_that_become_deployment_routes_or_files_are_validated(name):
    with pytest.raises(ValidationError, match="name"):
        ControlNetConfig(name=name, preset="tiny")
    with pytest.raises(ValidationError, match="model_name"):
        DLRMAppConfig(model_name=name)
    with pytest.raises(ValidationError, match="name"):
        ModelDescription(name=name)  # a profile bank entry is written to <directory>/<name>.json


@pytest.mark.parametrize("weights", ["../model.safetensors", "weights/model.safetensors", "/etc/passwd",
                                     "/x/../model.bin"])
def test_dlrm_weights_must_be_an_absolute_safetensors_path(weights):
    with pytest.raises(ValidationError, match="weights"):
        DLRMModelConfig(weights=weights)


@pytest.mark.parametrize("name", ["header-past-the-end", "overlapping-offsets", "shape-2e40-squared", "dtype-unknown"])
def test_lying_dlrm_weights_are_a_value_error_naming_the_file(name, tmp_path):
    path = write_lie(tmp_path, name)
    with pytest.raises(ValueError, match=f"DLRM weights {re.escape(str(path))}: not a valid safetensors file"):
        build_dlrm("tiny", weights=path)


def test_dlrm_weights_with_a_huge_header_are_refused_unparsed(tmp_path, monkeypatch):
    shipped = dlrm_preset_weights("tiny").read_bytes()
    (length,) = struct.unpack_from("<Q", shipped)
    header = {**json.loads(shipped[8:8 + length]), **json.loads(_empty_tensors(100_000))}
    path = tmp_path / "padded.safetensors"
    path.write_bytes(safetensors_bytes(header, shipped[8 + length:]))
    monkeypatch.setattr(dlrm_model, "safe_open", lambda *args, **kwargs: pytest.fail("safetensors parsed it"))
    with pytest.raises(ValueError, match=rf"DLRM weights {re.escape(str(path))}: header is \d+ bytes, over the "
                                         rf"{dlrm_model.MAX_WEIGHTS_HEADER_BYTES}-byte limit"):
        build_dlrm("tiny", weights=path)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_local_model_directories_load_safetensors_only(tmp_path, opened_files):
    model = tmp_path / "model"
    shutil.copytree(WEIGHTS_ROOT / "tiny", model, ignore=shutil.ignore_patterns("loras"))
    pickled = [model / "unet" / "diffusion_pytorch_model.bin", model / "controlnet" / "diffusion_pytorch_model.bin"]
    for path in pickled:
        path.with_suffix(".safetensors").unlink()
        path.write_bytes(pickle.dumps(_Payload(tmp_path / "executed")))
    with opened_files.recording() as opened:
        with pytest.raises(OSError, match=r"no file named diffusion_pytorch_model\.safetensors"):
            load_local(model)
        with pytest.raises(OSError, match=r"no file named diffusion_pytorch_model\.safetensors"):
            load_controlnet(model / "controlnet")
    assert not any(opens_of(opened, path) for path in pickled) and not (tmp_path / "executed").exists()
    for not_a_model in (tmp_path / "absent", model / "model_index.json"):
        with pytest.raises(ValueError, match="not a diffusers model directory"):
            load_local(not_a_model)


# --- hostile conditioning images ---------------------------------------------------------------------------------

LIMITS = {"max_bytes": 8 * 2**20, "max_pixels": 2048 * 2048}
OVER_PIXELS = "image has more than 4194304 pixels"


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _jpeg(image: np.ndarray, **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", **options)
    return buffer.getvalue()


def _with_frame_size(jpeg: bytes, width: int, height: int) -> bytes:
    """``jpeg`` with its baseline frame header declaring ``width`` x ``height``."""
    start = jpeg.index(b"\xff\xc0") + 5  # marker, length, precision
    return jpeg[:start] + struct.pack(">HH", height, width) + jpeg[start + 4:]


SMALL_JPEG = _jpeg(np.zeros((64, 64, 3), np.uint8))
_APP0_END = 4 + int.from_bytes(SMALL_JPEG[4:6], "big")  # SOI, then the JFIF segment
ZEROS_1MB = zlib.compress(bytes(2**20))  # a 1 KB IDAT: what a bomb's pixels compress to

IMAGE_BOMBS = {
    "png-1e10-pixels": (grey_png(100_000, 100_000, idat=ZEROS_1MB), OVER_PIXELS),
    "png-just-over-the-limit": (grey_png(2049, 2048, idat=ZEROS_1MB), OVER_PIXELS),
    "png-4e9-pixels-wide": (grey_png(2**32 - 1, 1, idat=ZEROS_1MB), OVER_PIXELS),
    "png-no-pixels": (grey_png(0, 64, idat=ZEROS_1MB), "0x64: it has no pixels"),
    "png-1-by-4M": (grey_png(4_000_000, 1), "4000000x1; its sides may be at most 8192 pixels"),
    "png-4M-by-1": (grey_png(1, 4_000_000), "1x4000000; its sides may be at most 8192 pixels"),
    "jpeg-65535-squared": (_with_frame_size(SMALL_JPEG, 65535, 65535), OVER_PIXELS),
    "jpeg-1-by-60000": (_with_frame_size(SMALL_JPEG, 60000, 1), "60000x1; its sides may be at most 8192 pixels"),
    "png-chunk-flood-before-data": (grey_png(64, 64, before_idat=png_chunk(b"abCd") * (MAX_SEGMENTS + 1)),
                                    f"PNG has more than {MAX_SEGMENTS} chunks"),
    "png-chunk-flood-after-data": (grey_png(64, 64, after_idat=png_chunk(b"tEXt", b"k\0v") * MAX_SEGMENTS),
                                   f"PNG has more than {MAX_SEGMENTS} chunks"),
    "png-idat-flood": (grey_png(64, 64, after_idat=png_chunk(b"IDAT") * MAX_SEGMENTS),
                       f"PNG has more than {MAX_SEGMENTS} chunks"),
    "jpeg-comment-flood": (SMALL_JPEG[:2] + b"\xff\xfe\x00\x02" * (MAX_SEGMENTS + 1) + SMALL_JPEG[2:],
                           f"JPEG has more than {MAX_SEGMENTS} segments before its first scan"),
    "jpeg-fill-byte-flood": (SMALL_JPEG[:2] + b"\xff" * (MAX_SEGMENTS + 1) + SMALL_JPEG[2:],
                             f"JPEG has more than {MAX_SEGMENTS} segments"),
    "jpeg-scan-bomb": (progressive_jpeg(scans=MAX_JPEG_SCANS + 1), f"JPEG has more than {MAX_JPEG_SCANS} scans"),
    "jpeg-two-frames": (SMALL_JPEG[:2] + SMALL_JPEG[SMALL_JPEG.index(b"\xff\xc0"):SMALL_JPEG.index(b"\xff\xc4")]
                        + SMALL_JPEG[2:], "two frame headers"),
    "jpeg-stray-bytes": (SMALL_JPEG[:_APP0_END] + b"junk" + SMALL_JPEG[_APP0_END:],
                         "stray bytes before its first scan"),
    "jpeg-without-frame": (SMALL_JPEG[:2] + SMALL_JPEG[SMALL_JPEG.index(b"\xff\xda"):],
                           "no frame header before its first scan"),
    "png-without-ihdr": (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IEND"), "does not start with its IHDR"),
    "gif": (b"GIF89a" + bytes(64), "not a PNG or JPEG file"),
}


@pytest.mark.parametrize("name", IMAGE_BOMBS)
def test_image_bombs_are_refused_from_the_header_before_any_decoder_runs(name, monkeypatch):
    raw, message = IMAGE_BOMBS[name]
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: pytest.fail("PIL opened the image"))
    with python_peak_bytes() as peak, pytest.raises(ConditioningImageError, match=re.escape(message)):
        decode_image(_b64(raw), **LIMITS)
    assert peak[0] < REFUSAL_BYTES + 3 * len(raw)  # the base64 text and its decoded bytes


@pytest.mark.parametrize("cut", [20, 33, 45, 60, -30])  # past the last pixel (checksums, IEND) it still decodes
def test_truncated_png_is_refused(cut):
    png = base64.b64decode(encode_b64(square()))
    with pytest.raises(ConditioningImageError, match=r"IHDR|corrupt or truncated"):
        decode_image(_b64(png[:cut]), **LIMITS)


@pytest.mark.parametrize("cut", [4, 30, 200, -40])
def test_truncated_jpeg_is_refused(cut):
    jpeg = _jpeg(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    with pytest.raises(ConditioningImageError, match="truncated"):
        decode_image(_b64(jpeg[:cut]), **LIMITS)


def test_side_limit_is_configurable():
    tall = grey_png(16, 512)
    assert decode_image(_b64(tall), **LIMITS, max_side=512).shape == (512, 16, 3)
    with pytest.raises(ConditioningImageError, match="16x512; its sides may be at most 511 pixels"):
        decode_image(_b64(tall), **LIMITS, max_side=511)


def _pil_png(image: np.ndarray, *, palette: bool = False) -> bytes:
    picture = Image.fromarray(image)
    buffer = io.BytesIO()
    (picture.convert("P") if palette else picture).save(buffer, format="PNG")
    return buffer.getvalue()


def _cv2_encoded(extension: str) -> bytes:
    ok, encoded = cv2.imencode(extension, square(96))
    assert ok
    return encoded.tobytes()


REAL_FILES = {
    "png-rgba": lambda: _pil_png(np.zeros((40, 30, 4), np.uint8)),
    "png-palette": lambda: _pil_png(np.zeros((40, 30, 3), np.uint8), palette=True),
    "png-cv2": lambda: _cv2_encoded(".png"),
    "jpeg-progressive-optimized": lambda: progressive_jpeg(48),
    "jpeg-exif-and-split-icc-profile": lambda: _jpeg(square(40), exif=Image.Exif().tobytes(),
                                                     icc_profile=bytes(200_000)),
    "jpeg-greyscale": lambda: _jpeg(np.zeros((40, 30), np.uint8)),
    "jpeg-cv2": lambda: _cv2_encoded(".jpg"),
}


@pytest.mark.parametrize("name", REAL_FILES)
def test_files_of_real_encoders_pass_the_header_checks(name):
    raw = REAL_FILES[name]()
    want = Image.open(io.BytesIO(raw))
    decoded = decode_image(_b64(raw), **LIMITS)
    assert decoded.shape == (want.height, want.width, 3)
    assert np.array_equal(decoded, np.asarray(want.convert("RGB")))


# --- over HTTP: every refusal is a 4xx naming the field, and nothing shared changes ------------------------------


@pytest.fixture(scope="module")
def hostile_root(tmp_path_factory) -> Path:
    """<root>/loras: a good LoRA, every lying file, an oversized one, a FIFO and links out to the canary."""
    root = tmp_path_factory.mktemp("hostile")
    loras, outside = root / "loras", root / "outside"
    loras.mkdir()
    outside.mkdir()
    (outside / f"{CANARY}.safetensors").write_bytes(b"canary")
    write_lora(loras / "good.safetensors", seed=1)
    for name in LIES:
        write_lie(loras, name)
    with (loras / "oversized.safetensors").open("wb") as file:
        file.truncate(API_MAX_FILE_BYTES + 1)
    os.mkfifo(loras / "fifo.safetensors")
    (loras / "escape.safetensors").symlink_to(outside / f"{CANARY}.safetensors")
    (loras / "relative-escape.safetensors").symlink_to(Path("..") / "outside" / f"{CANARY}.safetensors")
    return root


@pytest.fixture(scope="module")
def client(tiny_engine, fast_config, hostile_root):
    config = fast_config.model_copy(update={
        "lora": LoRAConfig(directory=hostile_root / "loras", max_file_bytes=API_MAX_FILE_BYTES)})
    with images_client(tiny_engine, config) as test_client:
        yield test_client


def _refusal(client: TestClient, body: dict, status: int) -> dict:
    response = client.post("/v1/images/generations", json={"prompt": "x", **body})
    assert response.status_code == status, response.text
    return response.json()["error"]


def _canary(root: Path) -> Path:
    return root / "outside" / f"{CANARY}.safetensors"


@pytest.mark.parametrize("name", [*LIES, "oversized"])
def test_lying_lora_file_is_422_naming_the_field_and_the_file(name, client):
    error = _refusal(client, {"loras": [{"name": "good"}, {"name": name}]}, 422)
    assert error["param"] == "loras[1].name" and error["code"] == "lora_load_failed"
    assert f"{name}.safetensors: " in error["message"]
    assert client.post("/v1/images/generations", json={"prompt": "still serving", "loras": [{"name": "good"}]}) \
        .status_code == 200


@pytest.mark.parametrize("template", HOSTILE_NAMES)
def test_hostile_lora_name_is_400_and_the_canary_is_never_opened(template, client, hostile_root, opened_files):
    with opened_files.recording() as opened:
        error = _refusal(client, {"loras": [{"name": hostile_name(template, hostile_root)}]}, 400)
    assert error["param"] == "loras[0].name"
    assert not opens_of(opened, _canary(hostile_root))


@pytest.mark.parametrize("name", ["escape", "relative-escape", "fifo"])
def test_lora_links_out_and_special_files_are_404_unopened(name, client, hostile_root, opened_files):
    with opened_files.recording() as opened:
        error = _refusal(client, {"loras": [{"name": name}]}, 404)
    assert error["param"] == "loras[0].name" and error["code"] == "lora_not_found"
    assert not opens_of(opened, _canary(hostile_root)) and not opens_of(opened, hostile_root / "loras" / name)


@pytest.mark.parametrize("template", [name for name in HOSTILE_NAMES if len(name) <= 256])
def test_hostile_controlnet_name_is_404_and_the_canary_is_never_opened(template, client, hostile_root,
                                                                       opened_files):
    controlnet = {"name": hostile_name(template, hostile_root), "image": encode_b64(square())}
    with opened_files.recording() as opened:
        error = _refusal(client, {"controlnets": [controlnet]}, 404)
    assert error["param"] == "controlnets[0].name" and error["code"] == "controlnet_not_found"
    assert not opens_of(opened, _canary(hostile_root))


@pytest.mark.parametrize("name", ["png-1e10-pixels", "png-1-by-4M", "jpeg-65535-squared", "png-chunk-flood-before-data",
                                  "jpeg-scan-bomb"])
def test_image_bomb_is_400_naming_the_image_field(name, client):
    raw, message = IMAGE_BOMBS[name]
    error = _refusal(client, {"controlnets": [{"name": "edges", "image": _b64(raw)}]}, 400)
    assert error["param"] == "controlnets[0].image" and message in error["message"]


def _file_digests(directory: Path) -> dict[str, str]:
    """sha256 of every regular file under ``directory`` (links not followed: a FIFO or a link out is not read)."""
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file() and not path.is_symlink()}


def _parameter_digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_hostile_requests_leave_files_and_weights_unchanged(client, tiny_engine, hostile_root, opened_files):
    def snapshot() -> dict[str, object]:
        return {"files": {str(root): _file_digests(root) for root in (hostile_root, *SHIPPED_WEIGHTS)},
                "unet": _parameter_digest(tiny_engine.denoiser.module),
                "text_encoder": _parameter_digest(tiny_engine.text_encoder)}

    before = snapshot()
    with opened_files.recording() as opened:
        for name in [*LIES, "oversized", "escape", "fifo"]:
            assert client.post("/v1/images/generations", json={"prompt": "x", "loras": [{"name": name}]}) \
                .status_code in (404, 422)
        for template in HOSTILE_NAMES:
            assert client.post("/v1/images/generations", json={
                "prompt": "x", "loras": [{"name": hostile_name(template, hostile_root)}]}).status_code == 400
        good = client.post("/v1/images/generations", json={"prompt": "x", "loras": [{"name": "good"}]})
        assert good.status_code == 200
    assert not opens_of(opened, _canary(hostile_root))
    assert snapshot() == before
