"""``profile_dlrm``'s flame summary: py-spy's collapsed stacks counted per frame, inclusive once per stack and
self at the leaf, with site-packages and repository paths cut to their tails."""

from benchmarks.profile_dlrm import arguments, frame_totals
from benchmarks.records import REPO, RESULTS

RUN = "run (/x/lib/python3.11/site-packages/ray/serve/replica.py:10)"
COLLAPSED = f"""\
thread (1);{RUN};step ({{repo}}/disagg/lookup.py:5) 7
thread (1);{RUN};{RUN} 3
thread (2);idle (/x/lib/python3.11/threading.py:3) 2
not a sample line
"""


def test_frames_are_counted_inclusive_once_per_stack_and_self_at_the_leaf():
    total, inclusive, leaf = frame_totals(COLLAPSED.format(repo=REPO))
    assert total == 12
    assert inclusive["run (ray/serve/replica.py)"] == 10  # the recursive stack counts once
    assert inclusive["step (disagg/lookup.py)"] == 7 and leaf["step (disagg/lookup.py)"] == 7
    assert leaf["run (ray/serve/replica.py)"] == 3
    assert "thread (1)" not in inclusive  # the thread is not a frame
    assert leaf["idle (threading.py)"] == 2


def test_options_are_bench_dlrms_with_the_profilers_own_defaults():
    args = arguments().parse_args(["--label", "after", "--systems", "disagg_fp32_1x1", "--batch", "256"])
    assert (args.label, args.systems, args.batch) == ("after", ["disagg_fp32_1x1"], 256)
    defaults = arguments().parse_args(["--label", "before"])
    assert defaults.systems == ["monolithic", "disagg_fp32"] and defaults.seconds == 15.0
    assert defaults.out == RESULTS / "profiles"
