"""``forward_by_shape``: one forward per latent shape of a batch's calls, answers back in call order."""

import asyncio

from serving.deployments.batching import forward_by_shape


def test_calls_of_one_shape_share_a_forward_and_answers_keep_call_order():
    forwards: list[list[str]] = []

    def forward(group: list[tuple[str, int]]) -> list[str]:
        forwards.append([name for name, _ in group])
        return [f"{name}@{size}" for name, size in group]

    calls = [("a", 64), ("b", 32), ("c", 64), ("d", 48), ("e", 32)]
    answers = asyncio.run(forward_by_shape(calls, lambda call: call[1], forward))
    assert answers == ["a@64", "b@32", "c@64", "d@48", "e@32"]
    assert forwards == [["a", "c"], ["b", "e"], ["d"]]
