"""tests/test_skip_summary.py: the end of a test run counts its skips by reason (tests/conftest.py),
so that a user sees which groups did not run and README.md's "Tests" says what runs them."""
import types

import conftest


class Reporter:
    """What pytest_terminal_summary uses of pytest's terminal reporter."""

    def __init__(self, skipped):
        self.stats = {"skipped": skipped} if skipped else {}
        self.lines = []

    def write_sep(self, sep, title):
        self.lines.append(f"{sep * 3} {title} {sep * 3}")

    def write_line(self, line):
        self.lines.append(line)


def skipped(reason, where="tests/test_x.py"):
    return types.SimpleNamespace(longrepr=(where, 1, "Skipped: " + reason))


def test_skips_are_counted_by_reason_most_first():
    gpu, onnx = "needs a CUDA GPU", conftest.NEEDS_ONNX
    reporter = Reporter([skipped(gpu, "a.py"), skipped(onnx), skipped(gpu, "b.py"),
                         skipped(gpu + "\nsecond line"), skipped("x" * 300)])
    conftest.pytest_terminal_summary(reporter)
    title, *rows = reporter.lines
    assert "5 skipped, by reason" in title
    assert rows[0] == f"     3  {gpu}"  # places and later lines do not split a reason
    assert rows[1] == f"     1  {onnx}" and len(rows) == 3  # ties: in the order first seen
    assert rows[2].startswith("     1  xxx") and rows[2].endswith("...") and len(rows[2]) < 300


def test_a_run_without_skips_adds_nothing():
    reporter = Reporter([])
    conftest.pytest_terminal_summary(reporter)
    assert reporter.lines == []
