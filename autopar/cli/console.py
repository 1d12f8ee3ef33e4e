"""What the command line prints: rich tables, a spinner and styled errors on a terminal, plain
aligned text otherwise (pipes, files, tests), so that ``| head`` and ``--json`` stay clean.

A ``Table`` is data (title, columns, rows of strings); ``render`` gives its plain text, and
``emit`` prints text and tables to stdout, through rich when stdout is a terminal."""

# rich is imported inside the functions that draw on a terminal, for start-up speed.
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.errors import InternalError


@dataclass(frozen=True, slots=True)
class Table:
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    right: frozenset[int] = field(default_factory=frozenset)  # right-aligned columns (numbers)
    header: bool = True

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise InternalError(f"table {self.title!r}: row {row} has {len(row)} cells, expected {len(self.columns)}")


def render(table: Table) -> str:
    """Plain text: the title, then columns two spaces apart, each as wide as its widest cell."""
    cells = ([list(table.columns)] if table.header else []) + [list(row) for row in table.rows]
    widths = [max((len(row[i]) for row in cells), default=0) for i in range(len(table.columns))]
    lines = [table.title] if table.title else []
    for row in cells:
        parts = [cell.rjust(width) if i in table.right else cell.ljust(width) for i, (cell, width) in enumerate(zip(row, widths))]
        lines.append(("  " + "  ".join(parts)).rstrip())
    return "\n".join(lines)


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def emit(blocks: Iterable[str | Table], stream: Any = None) -> None:
    """Print text blocks and tables, one blank line apart."""
    stream = stream or sys.stdout
    blocks = list(blocks)
    if not is_terminal(stream):
        print("\n\n".join(block if isinstance(block, str) else render(block) for block in blocks), file=stream)
        return
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console(file=stream, highlight=False)
    for number, block in enumerate(blocks):
        if number:
            console.print()
        if isinstance(block, str):
            console.print(block, markup=False)
            continue
        table = RichTable(
            title=block.title or None,
            title_justify="left",
            title_style="bold",
            show_header=block.header,
            header_style="bold",
            box=None,
            pad_edge=False,
        )
        for i, column in enumerate(block.columns):
            table.add_column(column, justify="right" if i in block.right else "left", overflow="fold")
        for row in block.rows:
            table.add_row(*row)
        console.print(table)


def print_error(text: str, stream: Any = None) -> None:
    """An error already laid out as lines (``autopar: error: ...`` then indented lines)."""
    stream = stream or sys.stderr
    if not is_terminal(stream):
        print(text, file=stream)
        return
    from rich.console import Console
    from rich.text import Text

    first, _, rest = text.partition("\n")
    head, sep, reason = first.partition("error:")
    line = Text(head + sep, style="bold red") + Text(reason)
    console = Console(file=stream, highlight=False)
    console.print(line)
    if rest:
        console.print(Text(rest))


class Progress:
    """Stage messages on stderr: a spinner with the current stage on a terminal (a long plan shows
    that it is alive), a line per message otherwise.

    A stage that runs ``heartbeat_s`` seconds without a message is never silent: a line says how
    long it has run and which autopar function the command is in (sampled from its stack), and
    again every ``heartbeat_s`` seconds, so that a slow plan (a 4-axis mesh, say) is told from a hung one."""

    def __init__(self, prog: str, stream: Any = None, heartbeat_s: float = 20.0) -> None:
        self.prog = prog
        self.stream = stream or sys.stderr
        self.heartbeat_s = heartbeat_s
        self._status: Any = None
        self._console: Any = None
        self._stage = "starting"
        self._since = self._stage_at = time.monotonic()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._caller = threading.get_ident()

    def __enter__(self) -> Progress:
        if is_terminal(self.stream):
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False)
            self._status = self._console.status(f"{self.prog}: starting ...")
            self._status.start()
        self._caller = threading.get_ident()
        self._since = self._stage_at = time.monotonic()
        self._thread = threading.Thread(target=self._beat, name="autopar-progress", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._done.wait(min(self.heartbeat_s, 1.0)):
            quiet = time.monotonic() - self._since
            if quiet < self.heartbeat_s:
                continue
            where = _where(self._caller)
            stage = self._stage.removeprefix(f"{self.prog}: ").rstrip(" .")
            self._write(
                f'{self.prog}: still working on "{stage}", {time.monotonic() - self._stage_at:.0f} s so far'
                f"{' (in ' + where + ')' if where else ''}; Ctrl-C stops it",
                stage=False,
            )

    def __call__(self, message: str) -> None:
        self.line(f"{self.prog}: {message}")

    def line(self, text: str) -> None:
        """A stage line as it is (the planner's log messages carry their own prefix)."""
        self._write(text, stage=True)

    def _write(self, text: str, stage: bool) -> None:
        with _LOCK:
            if stage:
                self._stage, self._stage_at = text, time.monotonic()
            self._since = time.monotonic()
            if self._status is None:
                print(text, file=self.stream, flush=True)
                return
            from rich.text import Text

            self._console.print(Text(text, style="dim"))
            if stage:
                self._status.update(text)

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._status is not None:
            self._status.stop()
            self._status = None


_LOCK = threading.Lock()


def _where(thread_id: int) -> str:
    """The innermost autopar function that thread ``thread_id`` is running, as "solver/choices.py:_edges"."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/autopar/" in path and "/autopar/cli/" not in path:
            return f"{path.rsplit('/autopar/', 1)[1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return ""


def table_rows(rows: Sequence[Sequence[Any]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(str(cell) for cell in row) for row in rows)
