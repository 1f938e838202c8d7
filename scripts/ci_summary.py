"""Where a test run's time went, from pytest's JUnit XML files: per suite its tests, outcomes and wall time, then
the slowest tests of all suites.

    python scripts/ci_summary.py out/ci/*.xml [--slowest 15]

A missing file (a suite that did not run, e.g. after an earlier one failed) is named, not an error.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Suite:
    """One JUnit file's totals and its test cases' durations (name, seconds)."""

    name: str
    tests: int
    failures: int
    errors: int
    skipped: int
    seconds: float
    cases: tuple[tuple[str, float], ...]


def read_suite(path: Path) -> Suite:
    """The totals of ``path``'s test suites (pytest writes one ``testsuite``, maybe under ``testsuites``)."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases = tuple((f"{case.get('classname', '')}::{case.get('name', '')}", float(case.get("time", 0.0)))
                  for suite in suites for case in suite.iter("testcase"))
    return Suite(name=path.stem, tests=sum(int(s.get("tests", 0)) for s in suites),
                 failures=sum(int(s.get("failures", 0)) for s in suites),
                 errors=sum(int(s.get("errors", 0)) for s in suites),
                 skipped=sum(int(s.get("skipped", 0)) for s in suites),
                 seconds=sum(float(s.get("time", 0.0)) for s in suites), cases=cases)


def summary(paths: list[Path], slowest: int) -> list[str]:
    """The summary's lines: a row per suite (or a note that its file is missing), a total, the slowest tests."""
    lines = [f"{'suite':<14} {'tests':>6} {'failed':>6} {'errors':>6} {'skipped':>7} {'minutes':>8}"]
    suites = []
    for path in paths:
        if not path.is_file():
            lines.append(f"{path.stem:<14} not run ({path} missing)")
            continue
        suite = read_suite(path)
        suites.append(suite)
        lines.append(f"{suite.name:<14} {suite.tests:>6} {suite.failures:>6} {suite.errors:>6} {suite.skipped:>7} "
                     f"{suite.seconds / 60:>8.1f}")
    lines.append(f"{'total':<14} {sum(s.tests for s in suites):>6} {sum(s.failures for s in suites):>6} "
                 f"{sum(s.errors for s in suites):>6} {sum(s.skipped for s in suites):>7} "
                 f"{sum(s.seconds for s in suites) / 60:>8.1f}")
    cases = sorted(((seconds, f"{suite.name}: {name}") for suite in suites for name, seconds in suite.cases),
                   reverse=True)[:slowest]
    if cases:
        lines += ["", f"slowest {len(cases)} tests (seconds; on xdist workers they overlap):"]
        lines += [f"{seconds:8.1f}  {name}" for seconds, name in cases]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="JUnit XML files, one per suite")
    parser.add_argument("--slowest", type=int, default=15, help="how many of the slowest tests to list")
    args = parser.parse_args(argv)
    print("\n".join(summary(args.files, args.slowest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
