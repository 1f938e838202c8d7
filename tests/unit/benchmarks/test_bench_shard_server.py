"""``bench_shard_server``: the before-issue-45 reply it measures against answers what the shard server answers, and
its report takes each ratio from the flavour the product keeps."""

import torch

from benchmarks import bench_shard_server as bench
from disagg.model_source import PresetSource
from disagg.rpc import packed, wire
from disagg.rpc._proto import embedding_pb2 as pb
from disagg.rpc.server import _Servicer
from disagg.tables import TableLayout, build_embedding_shard


def test_the_protobuf_baseline_answers_the_rows_the_shard_server_answers():
    shard = build_embedding_shard(PresetSource("tiny", 0), 0, TableLayout(2, row_wise_min_bytes=32768))
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, piece.rows, (at + 1,), generator=generator, dtype=torch.int32)
           for at, piece in enumerate(shard.slices)]
    raw = packed.encode_request(torch.cat(ids), [part.shape[0] for part in ids])
    ours = packed.parse_reply(_Servicer(shard, pb.ShardInfo(), None, wire.DEFAULT_MAX_ELEMENTS).answer(raw))
    before = packed.parse_reply(bench.protobuf_reply(shard, raw))
    assert torch.equal(ours.rows, before.rows) and ours.widths == before.widths and ours.version == before.version


def test_report_takes_the_ratios_from_the_kept_flavour():
    def run(cpu: float) -> dict:
        return {"calls_per_s": 1000.0, "calls": 5000, "errors": 0, "cpu_us_per_call": cpu, "system_us_per_call": 50.0}

    results = {256: {"ids_per_call": 2500, "request_bytes": 10_000, "tensor_work_us": [200.0, 200.0],
                     "flavours": {"aio-pool-protobuf": [run(1200.0)], "aio-stream": [run(600.0)],
                                  "sync-pool": [run(500.0)], "aio-null": [run(300.0)]}}}
    args = bench.arguments().parse_args(["--flavours", "aio-pool-protobuf", "aio-stream", "sync-pool", "aio-null"])
    table, summary = bench.report(args, results)
    assert summary == {"machinery_over_tensor_work_b256": 2.0, "cpu_ratio_before_over_kept_b256": 2.0,
                       "grpc_floor_over_tensor_work_b256": 1.5}
    assert "cheapest serving rows: sync-pool" in table
    assert "| 256 | 2500 | 200 | aio-stream | 1000 [1000, 1000] | 600 [600, 600] | 50 | 400 | 2.00x | 0 |" in table
    assert "| 256 | 2500 | 0 | aio-null | 1000 [1000, 1000] | 300 [300, 300] | 50 | 300 | 1.50x | 0 |" in table
