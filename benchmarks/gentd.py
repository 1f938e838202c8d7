"""GenTD26, a production Stable Diffusion service's request trace (``../shared/traces/README.md``): read, cut to a
window, and mapped onto what a benchmark serves.

What the trace gives is kept: arrival times, request type, images per prompt, steps, base model, number of LoRAs,
prompt and negative-prompt lengths. What it leaves out is drawn, seeded, by a stated rule (``replay``): which LoRAs
(a Zipf over a pool per served model), the prompt text (words to the traced length), the arrival within its
second (the trace keeps whole seconds). Every traced request is replayed whatever its traced status (each was
load), except those the trace records no parameters for (no base model, steps or images: 25 PENDING lines).
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
REQUESTS = TRACES / "gentd26_lora_request_trace.csv"
LOAD_LATENCIES = TRACES / "gentd26_lora_update_latency_anon.csv"

#: ``predict_type`` -> what a replayed request is: text-to-image, an edit without a mask, an edit with one.
KINDS = {"TXT_2_IMG": "generate", "IMG_2_IMG": "img2img", "INPAINTING": "inpaint"}
COLUMNS = ("gmt_create", "predict_type", "num_images_per_prompt", "num_inference_steps",
           "checkpoint_model_version_id", "num_lora", "prompt_length", "negative_prompt_length")
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
#: Images per prompt of a request whose field is empty (the Images API's default).
DEFAULT_IMAGES = 1
WORDS = ("a", "red", "circle", "on", "white", "background", "blue", "square", "small", "large", "green", "triangle",
         "bright", "dark", "soft", "light", "photo", "of", "the", "in", "style", "detailed", "portrait", "city")


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file, the line and the field."""

    def __init__(self, path: Path, line: int, field: str, message: str) -> None:
        super().__init__(f"{path}:{line}: {field}: {message}")
        self.line, self.field = line, field


@dataclass(frozen=True)
class TracedRequest:
    """One line of the request trace (``created``: POSIX seconds, the trace's times read as UTC)."""

    line: int
    created: float
    predict_type: str
    images: int
    steps: int
    model: str
    loras: int
    prompt_chars: int
    negative_chars: int


def _count(path: Path, line: int, field: str, text: str, *, least: int, empty: int | None = None) -> int:
    """A whole number written as the trace writes them (``"30.0"``), at least ``least``; ``empty`` for ``""`` (an
    error where None)."""
    if text == "":
        if empty is None:
            raise TraceError(path, line, field, "empty")
        return empty
    try:
        value = float(text)
    except ValueError:
        raise TraceError(path, line, field, f"{text!r} is not a number") from None
    if not math.isfinite(value) or value != int(value) or value < least:
        raise TraceError(path, line, field, f"{text!r} is not a whole number >= {least}")
    return int(value)


def _parse(path: Path, line: int, row: dict[str, str]) -> TracedRequest | None:
    """The request of one line; None for a line with no parameters (no base model, steps or images)."""
    if not (row["checkpoint_model_version_id"] or row["num_inference_steps"] or row["num_images_per_prompt"]):
        return None
    try:
        created = datetime.strptime(row["gmt_create"], TIME_FORMAT).replace(tzinfo=UTC).timestamp()
    except ValueError:
        raise TraceError(path, line, "gmt_create", f"{row['gmt_create']!r} is not a time like "
                                                   "2024-12-05 23:42:41") from None
    if row["predict_type"] not in KINDS:
        raise TraceError(path, line, "predict_type", f"{row['predict_type']!r} is not one of {', '.join(KINDS)}")
    if not row["checkpoint_model_version_id"]:
        raise TraceError(path, line, "checkpoint_model_version_id", "empty on a line with other parameters")
    return TracedRequest(
        line=line, created=created, predict_type=row["predict_type"],
        images=_count(path, line, "num_images_per_prompt", row["num_images_per_prompt"], least=1,
                      empty=DEFAULT_IMAGES),
        steps=_count(path, line, "num_inference_steps", row["num_inference_steps"], least=1),
        model=row["checkpoint_model_version_id"],
        loras=_count(path, line, "num_lora", row["num_lora"], least=0),
        prompt_chars=_count(path, line, "prompt_length", row["prompt_length"], least=0, empty=0),
        negative_chars=_count(path, line, "negative_prompt_length", row["negative_prompt_length"], least=0,
                              empty=0),
    )


def read_requests(path: Path = REQUESTS) -> list[TracedRequest]:
    """Every request of the trace with parameters, in arrival order; a field that cannot be read raises
    ``TraceError`` naming its line and field."""
    path = Path(path)
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        missing = [column for column in COLUMNS if column not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(path, 1, missing[0], f"missing column (the header lists {reader.fieldnames})")
        parsed = [_parse(path, reader.line_num, {key: (value or "").strip() for key, value in row.items()
                                                 if key is not None}) for row in reader]
    requests = [request for request in parsed if request is not None]
    if not requests:
        raise TraceError(path, 2, "gmt_create", "the trace holds no request")
    return sorted(requests, key=lambda request: request.created)


def read_load_latencies_ms(path: Path = LOAD_LATENCIES) -> np.ndarray:
    """The LoRA load latencies (the ``value`` column, milliseconds), every one > 0."""
    path = Path(path)
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        if "value" not in (reader.fieldnames or ()):
            raise TraceError(path, 1, "value", f"missing column (the header lists {reader.fieldnames})")
        values = []
        for row in reader:
            try:
                value = float(row["value"])
            except ValueError:
                raise TraceError(path, reader.line_num, "value", f"{row['value']!r} is not a number") from None
            if not math.isfinite(value) or value <= 0:
                raise TraceError(path, reader.line_num, "value", f"{row['value']!r} is not a latency > 0")
            values.append(value)
    if not values:
        raise TraceError(path, 2, "value", "the file holds no latency")
    return np.array(values)


def parse_time(text: str) -> float:
    """``2024-12-05 23:42:41`` (or ISO 8601 with a ``T``) as POSIX seconds, read as UTC."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def busiest_window(requests: list[TracedRequest], hours: float) -> tuple[float, float]:
    """The ``hours``-long window ``[start, start + hours)`` holding the most arrivals, starting at an arrival (the
    earliest such window)."""
    created = np.array([request.created for request in requests])
    ends = np.searchsorted(created, created + 3600 * hours, side="left")
    first = int(np.argmax(ends - np.arange(len(created))))
    return float(created[first]), float(created[first] + 3600 * hours)


def in_window(requests: list[TracedRequest], start: float, end: float) -> list[TracedRequest]:
    return [request for request in requests if start <= request.created < end]


def served_model_names(requests: list[TracedRequest], count: int) -> dict[str, str]:
    """Each traced base model -> one of ``count`` served models ``m0`` .. ``m<count-1>``: ranked by requests (ties
    by name), rank ``r`` goes to ``m<r % count>``: the top ``count`` get a model each, the rest are dealt over
    them in rank order."""
    ranked = sorted(Counter(request.model for request in requests).items(), key=lambda item: (-item[1], item[0]))
    return {model: f"m{rank % count}" for rank, (model, _) in enumerate(ranked)}


@dataclass(frozen=True)
class ReplayedRequest:
    """What one traced request becomes: when it is sent (seconds from the window's start, compressed), what it
    asks of which served model, and the trace line it comes from."""

    offset_s: float
    kind: str
    model: str
    n: int
    steps: int
    loras: tuple[str, ...]
    prompt: str
    negative_prompt: str | None
    seed: int
    line: int

    @property
    def shape(self) -> tuple[str, str, int, int]:
        """What its unloaded latency depends on besides its LoRAs: model, kind, images, steps."""
        return self.model, self.kind, self.n, self.steps


def lora_name(model: str, index: int) -> str:
    return f"{model}_lora{index}"


def words(chars: int, rng: np.random.Generator) -> str:
    """Seeded words, exactly ``chars`` characters long."""
    text = ""
    while len(text) < chars:
        text += ("" if not text else " ") + WORDS[int(rng.integers(len(WORDS)))]
    return text[:chars]


def replay(requests: list[TracedRequest], start: float, *, compression: float, step_scale: float,
           models: dict[str, str], loras_per_model: int, zipf_exponent: float, max_prompt_chars: int,
           seed: int) -> list[ReplayedRequest]:
    """``requests`` (of a window from ``start``) as sent: arrival ``(created + u - start) / compression`` with
    ``u`` uniform in [0, 1) (the trace keeps whole seconds), ``steps = max(1, round(steps * step_scale))``, the
    served model by ``models``, ``loras`` distinct LoRAs of that model's pool of ``loras_per_model`` drawn by a
    Zipf of ``zipf_exponent`` (more than the pool: all of it), prompts of the traced lengths (at most
    ``max_prompt_chars``), an empty negative prompt as none. Request ``i`` gets seed ``seed + i``."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, loras_per_model + 1) ** zipf_exponent
    weights /= weights.sum()
    replayed = []
    for index, request in enumerate(requests):
        model = models[request.model]
        drawn = rng.choice(loras_per_model, size=min(request.loras, loras_per_model), replace=False, p=weights)
        negative = words(min(request.negative_chars, max_prompt_chars), rng)
        replayed.append(ReplayedRequest(
            offset_s=(request.created + float(rng.random()) - start) / compression,
            kind=KINDS[request.predict_type], model=model, n=request.images,
            steps=max(1, round(request.steps * step_scale)),
            loras=tuple(lora_name(model, int(i)) for i in sorted(drawn)),
            prompt=words(min(max(request.prompt_chars, 1), max_prompt_chars), rng),
            negative_prompt=negative or None, seed=seed + index, line=request.line))
    return sorted(replayed, key=lambda request: request.offset_s)
