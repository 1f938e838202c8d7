"""An embedding shard replica's shutdown, without Ray: it withdraws its address and stops its gRPC server, and a
directory that is gone (deleted with the app) does not hold the shutdown until Serve force-kills the replica."""

import asyncio

import pytest

from disagg.deployments import shards
from disagg.deployments.shards import EmbeddingShardServer


class _Server:
    def __init__(self) -> None:
        self.stopped_with: float | None = None

    async def stop(self, grace: float) -> None:
        self.stopped_with = grace


class _Method:
    def __init__(self, answer) -> None:
        self.calls: list[tuple] = []
        self._answer = answer

    def remote(self, *args):
        self.calls.append(args)
        return self._answer()


class _Directory:
    def __init__(self, answer) -> None:
        self.withdraw = _Method(answer)


SHUTDOWN = EmbeddingShardServer.func_or_class.__del__  # what Serve awaits on a graceful replica shutdown


class _Replica(EmbeddingShardServer.func_or_class):
    def __del__(self) -> None:  # garbage collection: the shutdown under test is awaited explicitly
        pass


def _replica(directory: _Directory) -> _Replica:
    replica = object.__new__(_Replica)
    replica._directory, replica._server, replica._shard_index, replica._address = directory, _Server(), 1, "h:7"
    return replica


async def _answered() -> None:
    return None


def test_a_stopping_shard_withdraws_its_address_then_stops_serving():
    directory = _Directory(_answered)
    replica = _replica(directory)
    asyncio.run(SHUTDOWN(replica))
    assert directory.withdraw.calls == [(1, "h:7")]
    assert replica._server.stopped_with == 1.0


@pytest.mark.parametrize("answer", ["never", "refused"])
def test_a_stopping_shard_whose_directory_is_gone_still_stops_serving(answer, monkeypatch, all_logs):
    monkeypatch.setattr(shards, "WITHDRAW_TIMEOUT_S", 0.05)

    async def never() -> None:  # a call to a deployment deleted with the app: no replica will ever answer it
        await asyncio.Event().wait()

    async def refused() -> None:
        raise RuntimeError("deployment ShardDirectory was deleted")

    replica = _replica(_Directory({"never": never, "refused": refused}[answer]))
    asyncio.run(asyncio.wait_for(SHUTDOWN(replica), timeout=30))  # the old shutdown waited here for ever
    assert replica._server.stopped_with == 1.0
    assert "embedding shard 1 at h:7: not withdrawn from the directory" in all_logs.text
