"""Checksums of checkpoint records: computed while DCP writes them, verified before a load.

``ChecksumWriter`` is DCP's ``FileSystemWriter`` whose file streams sum (CRC-32) the bytes as
they pass on their way to the file: DCP asks a stream for its position (``tell``) before and
after each record it writes, so the bytes between two such calls are one record, and its sum is
ready when the record is written, with no second pass over the data. Each rank then writes the
sums of its records into ``<prefix>checksums.json`` beside its ``.distcp`` files (``__0_``
prefix: rank 0's), a plain JSON side file that DCP itself does not read, so the checkpoint stays
a plain DCP checkpoint.

``checksum_problems`` re-sums the records that ``.metadata`` points to, before anything is
loaded (each rank sums its share of the files, and every rank hears of any difference) and names
each file and tensor whose bytes differ. A checkpoint without side files (written before
checksums, or by another tool) is read as it is.
"""

from __future__ import annotations

import io
import json
import os
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from autopar.errors import CheckpointError

SUFFIX = "checksums.json"
_CHUNK = 1 << 22


class _SummingStream(io.RawIOBase):
    """A write stream that sums the bytes between consecutive ``tell`` calls (one DCP record)."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.position = raw.tell()
        self.start, self.sum = self.position, 0
        self.records: dict[tuple[int, int], int] = {}  # (offset, end) -> CRC-32

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        written = len(view) if written is None else written
        self.sum = zlib.crc32(view[:written], self.sum)
        self.position += written
        return written

    def tell(self) -> int:
        if self.position > self.start:
            self.records[(self.start, self.position)] = self.sum
        self.start, self.sum = self.position, 0
        return self.position

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.tell()
        super().close()


class _SummingFileSystem(FileSystem):
    """DCP's file system whose written files report the sums of their records."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, dict[tuple[int, int], int]] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            summing = _SummingStream(stream)
            yield summing
            summing.tell()
            with self._lock:
                self.sums[Path(path).name] = summing.records


class ChecksumWriter(FileSystemWriter):
    """``FileSystemWriter`` that also writes each record's CRC-32 (module docstring)."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _SummingFileSystem()

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        records: dict[str, list[list[int]]] = {}
        for result in future.wait():  # FileSystemWriter writes before it returns
            info = result.storage_data
            summed = self.fs.sums.get(info.relative_path, {}).get((info.offset, info.offset + info.length))
            if summed is None:
                raise CheckpointError(
                    f"autopar could not sum record {result.index.fqn!r} of {info.relative_path} while writing it "
                    "(this torch's DCP writes records in a way autopar does not know): please report it"
                )
            records.setdefault(info.relative_path, []).append([info.offset, info.length, summed])
        side = Path(self.path) / f"{plan.storage_data.prefix}{SUFFIX}"
        with open(side, "w") as handle:
            json.dump({"algorithm": "crc32", "records": records}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        return future


def _saved_sums(directory: Path) -> dict[str, dict[tuple[int, int], int]] | None:
    """The sums the side files hold, by file and (offset, length); None without side files."""
    sides = sorted(directory.glob(f"*{SUFFIX}"))
    if not sides:
        return None
    sums: dict[str, dict[tuple[int, int], int]] = {}
    for side in sides:
        try:
            records = json.loads(side.read_text())["records"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(
                f"the checkpoint at {directory} is damaged: its checksum file {side.name} cannot be read "
                f"({type(error).__name__}). No tensor was loaded; restore the file or load another checkpoint"
            ) from None
        for name, entries in records.items():
            for offset, length, summed in entries:
                sums.setdefault(name, {})[(int(offset), int(length))] = int(summed)
    return sums


def _sum_range(handle: Any, offset: int, length: int) -> int:
    handle.seek(offset)
    summed, left = 0, length
    while left > 0:
        chunk = handle.read(min(_CHUNK, left))
        if not chunk:
            break
        summed = zlib.crc32(chunk, summed)
        left -= len(chunk)
    return summed


def checksum_problems(directory: Path, metadata: Metadata, rank: int = 0, world_size: int = 1) -> list[str]:
    """Each record of this rank's share of the files (every ``world_size``-th, from ``rank``)
    whose bytes do not sum to what was saved, as 'file: tensor ... (bytes a..b)'."""
    sums = _saved_sums(directory)
    if sums is None:
        return []
    names: dict[tuple[str, int, int], list[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        names.setdefault((info.relative_path, int(info.offset), int(info.length)), []).append(index.fqn)
    files = sorted({key[0] for key in names})[rank::world_size]
    problems = []
    for name in files:
        records = sorted((offset, length) for path, offset, length in names if path == name)
        with open(directory / name, "rb") as handle:
            for offset, length in records:
                tensors = ", ".join(sorted(set(names[(name, offset, length)])))
                saved = sums.get(name, {}).get((offset, length))
                if saved is None:
                    problems.append(f"{name}: {tensors} (bytes {offset}..{offset + length}) has no saved checksum")
                elif _sum_range(handle, offset, length) != saved:
                    problems.append(f"{name}: {tensors} (bytes {offset}..{offset + length}) differs from what was saved")
    return problems


__all__ = ["ChecksumWriter", "checksum_problems"]
