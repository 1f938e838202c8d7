"""Reading swiftserve's metrics back from Ray's Prometheus endpoints (one per node's metrics agent)."""

from __future__ import annotations

from collections import defaultdict

import httpx
import ray
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from serving.common.metrics import MetricSpec

RAY_PREFIX = "ray_"


def scrape() -> dict[str, list[Sample]]:
    """The swiftserve samples of every alive node's metrics agent, by sample name without Ray's prefix."""
    samples: dict[str, list[Sample]] = defaultdict(list)
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        try:
            text = httpx.get(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics",
                             timeout=10).text
        except httpx.HTTPError:  # an agent restarting: the next scrape asks again
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name.removeprefix(RAY_PREFIX)
                if name.startswith("swiftserve_"):
                    samples[name].append(sample)
    return samples


def metric_value(samples: dict[str, list[Sample]], metric: MetricSpec, labels: dict[str, str]) -> float:
    """A counter's total, a histogram's observation count or a gauge's largest value, over the samples that
    carry ``labels`` (summed across replicas)."""
    name = {"counter": f"{metric.name}_total", "histogram": f"{metric.name}_count", "gauge": metric.name}[metric.kind]
    values = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    if metric.kind == "gauge":
        return max(values, default=0.0)
    return sum(values)
