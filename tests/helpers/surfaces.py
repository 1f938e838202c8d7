"""Synthetic performance surfaces: one functional form, per-model latent factors, so optima move.

Per replica, a batch of ``b_eff`` requests takes ``T = overhead * b_eff + (c0 + c1 * b_eff) / share**gamma`` ms
(host work that a bigger share does not speed up, a fixed per-batch cost that batching amortises, per-request
compute that saturates it). Batches fill to ``b_eff = b * (1 - (1 - fill0) * exp(-wait / tau))``. The SLO
``p99 = wait + 2 T`` cuts off large batches with long waits; on memory-bound models a batch larger than
``memory * share`` fails. Replicas help up to a latent count (host/device overlap) and then contend, and
oversubscribing the machine slows every replica down. The objective is the rate per unit of share, with 3%
multiplicative measurement noise. These are sanity-check surfaces, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoconfig.bank import BankEntry, ProfileRecord
from autoconfig.space import KNOB_NAMES, Configuration, SearchSpace


def grid_entry(name: str, values: list[float], space: SearchSpace) -> BankEntry:
    """A full-grid entry of ``space`` whose objective follows ``values`` in enumeration order (NaN: SLO violated)."""
    trials = [
        ProfileRecord(config=c, status="slo_violated")
        if np.isnan(v)
        else ProfileRecord(config=c, status="ok", rps=v, p50_ms=1.0, p99_ms=2.0, error_rate=0.0, objective=v)
        for c, v in zip(space.configurations(), values, strict=True)
    ]
    return BankEntry(model={"name": name, "preset": "tiny"}, machine={"cpus": 2}, space=space, trials=trials)


def shortcuts(*values: float) -> Configuration:
    """A configuration of the shortcut knobs, in ``KNOB_NAMES`` order (``torch_threads`` only when given)."""
    return Configuration(dict(zip(KNOB_NAMES, values, strict=False)))


_NOISE = 0.03


@dataclass(frozen=True)
class LatentFactors:
    """What distinguishes one synthetic model from another (times in ms)."""

    c0_ms: float
    c1_ms: float
    overhead_ms: float
    gamma: float
    fill0: float
    tau_ms: float
    slo_ms: float
    memory_items: float | None  # None: no memory limit
    best_replicas: float
    replica_penalty: float
    capacity: float

    @classmethod
    def sample(cls, rng: np.random.Generator, space: SearchSpace) -> LatentFactors:
        """Factors scaled to ``space`` (its longest wait and largest total share)."""
        waits = space.values("batch_wait_timeout_s") if "batch_wait_timeout_s" in space.knob_names else (0.0,)
        scale_ms = max(1000 * max(waits), 1.0)
        c0, c1, overhead = (
            np.exp(rng.uniform(np.log(lo), np.log(hi))) * scale_ms
            for lo, hi in ((0.02, 0.5), (0.002, 0.1), (0.0005, 0.01))
        )
        total_share = max(c["num_replicas"] * c["device_share"] for c in space.configurations())
        largest_batch = max(space.values("max_batch_size"))
        return cls(
            c0_ms=c0,
            c1_ms=c1,
            overhead_ms=overhead,
            gamma=rng.uniform(0.5, 0.95),
            fill0=rng.uniform(0.3, 0.9),
            tau_ms=scale_ms * rng.uniform(0.1, 1.0),
            slo_ms=(c0 + c1 + overhead) * np.exp(rng.uniform(np.log(3), np.log(30))),
            memory_items=largest_batch * rng.uniform(0.5, 4) if rng.random() < 0.5 else None,
            best_replicas=rng.uniform(1, max(space.values("num_replicas"))),
            replica_penalty=rng.uniform(0.05, 0.4),
            capacity=total_share * rng.uniform(0.5, 1.0),
        )


def profile(factors: LatentFactors, space: SearchSpace, rng: np.random.Generator) -> list[ProfileRecord]:
    """One trial per configuration of ``space``, in enumeration order."""
    configs = space.configurations()
    column = {name: np.array([c[name] for c in configs], dtype=np.float64) for name in space.knob_names}
    batch = column["max_batch_size"]
    wait_ms = 1000 * column.get("batch_wait_timeout_s", np.zeros(len(configs)))  # diffusion has no batching timer
    share, replicas = column["device_share"], column["num_replicas"]
    effective_share = share
    if "torch_threads" in column:
        threads = column["torch_threads"]
        effective_share = np.minimum(share, threads) / (1 + 0.25 * np.maximum(threads - share, 0))
    f = factors
    filled = np.maximum(1.0, batch * (1 - (1 - f.fill0) * np.exp(-wait_ms / f.tau_ms)))
    batch_ms = f.overhead_ms * filled + (f.c0_ms + f.c1_ms * filled) / effective_share**f.gamma
    replica_factor = np.exp(-f.replica_penalty * (np.log2(replicas) - np.log2(f.best_replicas)) ** 2)
    oversubscription = np.minimum(1.0, f.capacity / (replicas * share))
    rps = replicas * 1000 * filled / batch_ms * replica_factor * oversubscription
    rps *= np.exp(rng.normal(0.0, _NOISE, size=len(configs)))
    p50_ms, p99_ms = wait_ms / 2 + batch_ms, wait_ms + 2 * batch_ms
    records = []
    for i, config in enumerate(configs):
        if f.memory_items is not None and batch[i] > f.memory_items * share[i]:
            records.append(ProfileRecord(config=config, status="failed"))
        elif p99_ms[i] > f.slo_ms:
            records.append(ProfileRecord(config=config, status="slo_violated", p99_ms=float(p99_ms[i])))
        else:
            records.append(
                ProfileRecord(
                    config=config,
                    status="ok",
                    rps=float(rps[i]),
                    p50_ms=float(p50_ms[i]),
                    p99_ms=float(p99_ms[i]),
                    error_rate=0.0,
                    objective=float(rps[i] / (replicas[i] * share[i])),
                )
            )
    return records


def synthetic_bank(n_models: int, space: SearchSpace, seed: int = 0) -> list[BankEntry]:
    """``n_models`` full-grid entries named ``synthetic-<i>``, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    entries = []
    for i in range(n_models):
        factors = LatentFactors.sample(rng, space)
        entries.append(
            BankEntry(
                model={"name": f"synthetic-{i}", "factors": vars(factors)},
                machine={"kind": "synthetic"},
                space=space,
                trials=profile(factors, space, rng),
            )
        )
    return entries
