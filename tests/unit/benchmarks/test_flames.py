"""py-spy's collapsed stacks counted per frame, inclusive once per stack and self at the leaf, with site-packages and
repository paths cut to their tails; and per thread."""

from benchmarks.flames import frame_totals, thread_samples
from benchmarks.records import REPO

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


def test_samples_are_counted_per_thread():
    assert thread_samples(COLLAPSED.format(repo=REPO)) == {"thread (1)": 10, "thread (2)": 2}
