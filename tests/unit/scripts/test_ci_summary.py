"""scripts/ci_summary.py: where a test run's time went, from the JUnit files pytest writes."""

import subprocess
import sys

from tests.helpers import REPO

UNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" tests="4" time="150.0">
<testcase classname="tests.unit.a" name="test_fast" time="0.5"/>
<testcase classname="tests.unit.a" name="test_slow" time="90.0"><failure message="x"/></testcase>
<testcase classname="tests.unit.b" name="test_skipped" time="0.0"><skipped message="y"/></testcase>
<testcase classname="tests.unit.b" name="test_other" time="12.0"/>
</testsuite></testsuites>"""
SMOKE = """<?xml version="1.0" encoding="utf-8"?>
<testsuite name="pytest" errors="1" failures="0" skipped="0" tests="1" time="60.0">
<testcase classname="tests.smoke.c" name="test_bench" time="60.0"><error message="z"/></testcase>
</testsuite>"""


def test_the_summary_totals_each_suite_names_a_missing_one_and_lists_the_slowest(tmp_path):
    (tmp_path / "unit.xml").write_text(UNIT)
    (tmp_path / "smoke.xml").write_text(SMOKE)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "ci_summary.py"), str(tmp_path / "unit.xml"),
                           str(tmp_path / "integration.xml"), str(tmp_path / "smoke.xml"), "--slowest", "2"],
                          capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["unit", "4", "1", "0", "2", "2.5"]
    assert lines[2].startswith("integration") and "not run" in lines[2]
    assert lines[3].split() == ["smoke", "1", "0", "1", "0", "1.0"]
    assert lines[4].split() == ["total", "5", "1", "1", "2", "3.5"]
    assert lines[-2:] == ["    90.0  unit: tests.unit.a::test_slow", "    60.0  smoke: tests.smoke.c::test_bench"]
