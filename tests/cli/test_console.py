"""Terminal output through rich, plain text everywhere else."""

from __future__ import annotations

import io

from autopar.cli.console import Progress, Table, emit, print_error


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_rich_tables_and_styled_errors():
    table = Table("Operators", ("node", "cost ms"), (("scaled_dot_product_attention_1", "1.5000"),), right=frozenset({1}))
    out = _Terminal()
    emit(["header line", table], out)
    text = out.getvalue()
    assert "header line" in text and "Operators" in text and "scaled_dot_product_attention_1" in text
    err = _Terminal()
    print_error("autopar: error: InfeasibleError: no sharding fits\n  Raise the budget", err)
    assert "\x1b[" in err.getvalue() and "no sharding fits" in err.getvalue() and "Raise the budget" in err.getvalue()
    plain = io.StringIO()
    print_error("autopar: error: x\n  y", plain)
    assert plain.getvalue() == "autopar: error: x\n  y\n"


def test_progress_is_lines_off_a_terminal_and_a_spinner_on_one():
    plain = io.StringIO()
    with Progress("autopar", plain) as progress:
        progress("tracing ...")
        progress.line("autopar: solve: Optimal")
    assert plain.getvalue() == "autopar: tracing ...\nautopar: solve: Optimal\n"
    terminal = _Terminal()
    with Progress("autopar", terminal) as progress:
        progress("tracing ...")
    assert "autopar: tracing ..." in terminal.getvalue()


def test_a_stage_that_runs_long_is_never_silent():
    """A stage quiet for heartbeat_s says how long it has run and where (a 4-axis mesh plans for minutes)."""
    import time

    # The whole busy loop runs in a function whose file lies under autopar/, as a planning stage
    # does (a loop in this test's own frame would be outside autopar at some of the samples).
    source = "def busy(seconds):\n    start = time.monotonic()\n    while time.monotonic() - start < seconds:\n        pass\n"
    scope = {"time": time}
    exec(compile(source, "/site/autopar/solver/busy_stage.py", "exec"), scope)
    stream = io.StringIO()
    with Progress("autopar", stream=stream, heartbeat_s=0.3) as progress:
        progress("planning on mesh (2, 2, 2, 2) ...")
        scope["busy"](2.5)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "autopar: planning on mesh (2, 2, 2, 2) ..."
    beats = lines[1:]
    assert len(beats) >= 2, lines
    assert all(line.startswith('autopar: still working on "planning on mesh (2, 2, 2, 2)", ') for line in beats), lines
    assert "(in solver/busy_stage.py:busy)" in beats[-1] and "Ctrl-C stops it" in beats[-1]
