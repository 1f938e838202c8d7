"""``profile_dlrm``'s command line."""

from benchmarks.profile_dlrm import arguments
from benchmarks.records import RESULTS


def test_options_are_bench_dlrms_with_the_profilers_own_defaults():
    args = arguments().parse_args(["--label", "after", "--systems", "disagg_fp32_1x1", "--batch", "256"])
    assert (args.label, args.systems, args.batch) == ("after", ["disagg_fp32_1x1"], 256)
    defaults = arguments().parse_args(["--label", "before"])
    assert defaults.systems == ["monolithic", "disagg_fp32"] and defaults.seconds == 15.0
    assert defaults.out == RESULTS / "profiles"
