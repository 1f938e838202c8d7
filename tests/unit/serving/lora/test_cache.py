"""The host LRU of LoRAs: hits, shared in-flight loads, eviction by bytes, failures and replaced files."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from serving.lora import (
    InvalidLoRAName,
    LoRACache,
    LoRAFormatError,
    LoRALayer,
    LoRANotFound,
    LoRARegistry,
    LoRATargets,
    LoRAWeights,
)
from serving.presets import build_preset

WAIT = 10  # seconds; every wait is bounded so a bug fails instead of hanging
MODULES = ["down_blocks.1.resnets.0.time_emb_proj", "mid_block.attentions.0.transformer_blocks.0.attn1.to_q"]


@pytest.fixture(scope="module")
def targets() -> LoRATargets:
    tiny = build_preset("tiny")
    return LoRATargets.from_modules(tiny.denoiser, tiny.text_encoder)


def write_lora(path: Path, targets: LoRATargets, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in MODULES:
        down, up = targets.denoiser[module].factor_shapes(4)
        tensors[f"unet.{module}.lora_A.weight"] = torch.randn(down, generator=generator)
        tensors[f"unet.{module}.lora_B.weight"] = torch.randn(up, generator=generator)
    save_file(tensors, str(path))
    return path


def bump_mtime(path: Path) -> None:
    mtime = path.stat().st_mtime_ns + 10**9
    os.utime(path, ns=(mtime, mtime))


class FakeLoader:
    """Weights of ``sizes[stem]`` bytes; optionally blocks on ``gate`` or fails ``failures`` times first."""

    def __init__(self, sizes: dict[str, int], gate: threading.Event | None = None, failures: int = 0) -> None:
        self.sizes, self.gate, self.failures = sizes, gate, failures
        self.calls: list[Path] = []
        self.started = threading.Semaphore(0)

    def __call__(self, path: Path) -> LoRAWeights:
        self.calls.append(path)
        self.started.release()
        if self.gate is not None:
            assert self.gate.wait(WAIT)
        if self.failures:
            self.failures -= 1
            raise RuntimeError("disk on fire")
        layer = LoRALayer(down=torch.zeros(self.sizes[path.stem] // 4), up=torch.zeros(0), scale=1.0)
        return LoRAWeights.build(path.stem, {"m": layer}, {})


@pytest.fixture
def lora_dir(tmp_path) -> Path:
    directory = tmp_path / "loras"
    directory.mkdir()
    for name in "abcde":
        (directory / f"{name}.safetensors").write_bytes(b"not parsed by the fake loader")
    return directory


@pytest.fixture
def make_cache(lora_dir, targets):
    caches = []

    def make(loader=None, *, budget_bytes: int = 10**6, max_file_bytes: int = 10**6, **kwargs) -> LoRACache:
        cache = LoRACache(LoRARegistry(lora_dir), targets, budget_bytes=budget_bytes, max_file_bytes=max_file_bytes,
                          loader=loader, **kwargs)
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        cache.close()


def test_miss_then_hit(make_cache):
    loader = FakeLoader({"a": 400})
    cache = make_cache(loader)
    first = cache.get("a").result(WAIT)
    assert cache.stats()["misses"] == 1 and cache.stats()["hits"] == 0
    again = cache.get("a")
    assert again.done() and again.result() is first
    assert cache.contains("a") and not cache.contains("b")
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["entries"], stats["bytes"]) == (1, 1, 1, 400)
    assert len(loader.calls) == 1


def test_concurrent_requests_share_one_load(make_cache):
    gate = threading.Event()
    loader = FakeLoader({"a": 400}, gate=gate)
    cache = make_cache(loader)
    first, second = cache.get("a"), cache.get("a")
    assert first is second and not first.done()
    with ThreadPoolExecutor(8) as pool:  # from many threads at once, still one load
        assert all(future is first for future in pool.map(lambda _: cache.get("a"), range(16)))
    assert not first.cancel()  # shared by every caller: nobody may cancel it for the others
    assert not cache.contains("a")
    assert cache.stats()["loading"] == 1 and cache.stats()["shared_loads"] == 17
    gate.set()
    weights = first.result(WAIT)
    assert weights.name == "a" and len(loader.calls) == 1
    assert cache.contains("a") and cache.stats()["loading"] == 0 and cache.stats()["misses"] == 1


def test_lru_eviction_by_bytes(make_cache):
    loader = FakeLoader({"a": 100, "b": 100, "c": 100, "d": 100, "e": 200})
    cache = make_cache(loader, budget_bytes=300)
    for name in "abc":
        cache.get(name).result(WAIT)
    assert cache.get("a").done()  # a becomes the most recently used
    cache.get("d").result(WAIT)  # 400 bytes > 300: b, the least recently used, goes
    assert [cache.contains(name) for name in "abcd"] == [True, False, True, True]
    assert (cache.stats()["bytes"], cache.stats()["evictions"]) == (300, 1)
    cache.get("e").result(WAIT)  # 200 more bytes: c then a go
    assert [cache.contains(name) for name in "abcde"] == [False, False, False, True, True]
    assert (cache.stats()["bytes"], cache.stats()["evictions"], cache.stats()["entries"]) == (300, 3, 2)


def test_entry_larger_than_the_budget_is_returned_not_cached(make_cache):
    cache = make_cache(FakeLoader({"a": 100, "b": 1000}), budget_bytes=500)
    cache.get("a").result(WAIT)
    assert cache.get("b").result(WAIT).nbytes == 1000
    assert not cache.contains("b") and cache.contains("a")
    assert (cache.stats()["bytes"], cache.stats()["evictions"]) == (100, 0)


def test_failed_load_leaves_nothing_and_a_retry_loads(make_cache):
    loader = FakeLoader({"a": 100}, failures=1)
    cache = make_cache(loader)
    failed = cache.get("a")
    with pytest.raises(RuntimeError, match="disk on fire"):
        failed.result(WAIT)
    stats = cache.stats()
    assert (stats["loads_failed"], stats["entries"], stats["loading"], stats["bytes"]) == (1, 0, 0, 0)
    retry = cache.get("a")  # same, unchanged file
    assert retry is not failed and retry.result(WAIT).name == "a"
    assert len(loader.calls) == 2 and cache.contains("a")


def test_real_file_fixed_after_a_format_error(make_cache, lora_dir, targets):
    cache = make_cache()
    with pytest.raises(LoRAFormatError, match=r"a\.safetensors: not a valid safetensors file"):
        cache.get("a").result(WAIT)
    assert not cache.contains("a") and cache.stats()["loads_failed"] == 1
    write_lora(lora_dir / "a.safetensors", targets, seed=0)
    weights = cache.get("a").result(WAIT)
    assert set(weights.denoiser) == set(MODULES) and cache.contains("a")


def test_replaced_file_is_reloaded(make_cache, lora_dir, targets):
    cache = make_cache()
    path = write_lora(lora_dir / "a.safetensors", targets, seed=0)
    old = cache.get("a").result(WAIT)
    write_lora(path, targets, seed=1)  # same size, new content
    bump_mtime(path)
    assert not cache.contains("a")
    new = cache.get("a").result(WAIT)
    assert not torch.equal(new.denoiser[MODULES[0]].down, old.denoiser[MODULES[0]].down)
    assert cache.get("a").result(WAIT) is new
    stats = cache.stats()
    assert (stats["misses"], stats["hits"], stats["entries"], stats["bytes"]) == (2, 1, 1, new.nbytes)


def test_file_replaced_during_its_load(make_cache, lora_dir):
    gate = threading.Event()
    loader = FakeLoader({"a": 100}, gate=gate)
    cache = make_cache(loader)
    stale = cache.get("a")
    assert loader.started.acquire(timeout=WAIT)
    bump_mtime(lora_dir / "a.safetensors")
    fresh = cache.get("a")
    assert fresh is not stale
    gate.set()
    assert stale.result(WAIT) is not fresh.result(WAIT)
    assert len(loader.calls) == 2 and cache.contains("a") and cache.stats()["entries"] == 1
    assert cache.get("a").result(WAIT) is fresh.result()


def test_name_errors_raise_before_any_work(make_cache, lora_dir):
    loader = FakeLoader({})
    cache = make_cache(loader)
    (lora_dir / "p.bin").write_bytes(b"x")
    with pytest.raises(InvalidLoRAName):
        cache.get("../a")
    for name in ("missing", "p"):
        with pytest.raises(LoRANotFound):
            cache.get(name)
    assert not cache.contains("../a") and not cache.contains("missing")
    assert loader.calls == [] and cache.stats()["misses"] == 0


def test_oversized_file_is_refused(make_cache, lora_dir, targets):
    path = write_lora(lora_dir / "a.safetensors", targets, seed=0)
    cache = make_cache(max_file_bytes=path.stat().st_size - 1)
    with pytest.raises(LoRAFormatError, match=r"over the \d+-byte limit"):
        cache.get("a").result(WAIT)
    assert cache.stats()["loads_failed"] == 1 and not cache.contains("a")


def test_alias_keeps_the_requested_name(make_cache, lora_dir, targets):
    write_lora(lora_dir / "a.safetensors", targets, seed=0)
    (lora_dir / "latest.safetensors").symlink_to(lora_dir / "a.safetensors")
    cache = make_cache(dtype=torch.float16)
    weights = cache.get("latest").result(WAIT)
    assert weights.name == "latest" and weights.denoiser[MODULES[0]].down.dtype == torch.float16


def test_closed_cache_refuses_new_loads(make_cache):
    cache = make_cache(FakeLoader({"a": 100}))
    cache.close()
    with pytest.raises(RuntimeError):
        cache.get("a")
    assert cache.stats()["loading"] == 0
