"""Stand-in embedding shards (any ``disagg.rpc.server.Shard``, as ``disagg.tables.TableShard`` is) and serving them on
loopback."""

import contextlib
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from disagg.rpc.server import EmbeddingServer


class ToyTables(nn.Module):
    """Sum-pooled bags, one id per row: ``ids_<t>`` [B] int64 -> ``pooled_<t>`` [B, dim]; counts its calls."""

    def __init__(self, tables: tuple[str, ...], rows: int, dim: int, seed: int, delay_s: float) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.tables = tables
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in tables)
        for bag in self.bags:
            nn.init.normal_(bag.weight, generator=generator)
        self.delay_s = delay_s
        self.calls = 0
        self._lock = threading.Lock()

    def forward(self, **ids: torch.Tensor) -> dict[str, torch.Tensor]:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay_s)
        return {
            f"pooled_{table}": bag(ids[f"ids_{table}"], torch.arange(len(ids[f"ids_{table}"])))
            for table, bag in zip(self.tables, self.bags, strict=True)
        }


class Gate:
    """Wraps a shard module: sets ``entered`` when a lookup reaches it, then waits for ``release`` to compute, and
    sets ``left`` when the call returns (or gives up after 10 s unreleased)."""

    def __init__(self, module) -> None:
        self.module = module
        self.entered = threading.Event()
        self.release = threading.Event()
        self.left = threading.Event()

    def __call__(self, **inputs):
        self.entered.set()
        try:
            assert self.release.wait(10), "never released"
            return self.module(**inputs)
        finally:
            self.left.set()


@dataclass(frozen=True)
class ToyShard:
    """Stand-in for ``disagg.tables.TableShard``."""

    index: int
    module: ToyTables
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    parameter_bytes: int
    version: str = "toy-v1"


def toy_shard(
    index: int = 0,
    tables: tuple[str, ...] = ("a", "b"),
    *,
    rows: int = 10,
    delay_s: float = 0.0,
    version: str = "toy-v1",
):
    module = ToyTables(tables, rows, dim=4, seed=index, delay_s=delay_s)
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    inputs, outputs = tuple(f"ids_{t}" for t in tables), tuple(f"pooled_{t}" for t in tables)
    return ToyShard(index, module, inputs, outputs, size, version)


def toy_inputs(shard: ToyShard, batch: int = 3) -> dict[str, torch.Tensor]:
    return {name: torch.arange(batch, dtype=torch.int64) % 10 for name in shard.input_names}


@contextlib.asynccontextmanager
async def serving(shard: ToyShard, **options):
    server = EmbeddingServer(shard, **options)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)
