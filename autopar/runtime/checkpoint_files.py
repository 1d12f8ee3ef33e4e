"""Checkpoint directories that are either whole or absent: staging, a commit marker, and checks.

A save never writes into the checkpoint it replaces. ``autopar.checkpoint.save(path, ...)``:

1. rank 0 finishes or clears what a killed save left (``recover``), then every rank writes its
   shards with ``dcp.save`` into the sibling directory ``<path>.saving`` (DCP's coordinator writes
   ``.metadata`` last, once every rank's shards are written);
2. rank 0 writes the commit marker ``.autopar-commit`` into it (JSON: the format, the world size,
   every file and its size), fsynced;
3. rank 0 swaps the directories: ``path`` → ``<path>.replaced``, ``<path>.saving`` → ``path``
   (two renames within one parent directory), then deletes ``<path>.replaced``.

A save killed at any point leaves one complete checkpoint: before step 3, ``path`` is the old one
untouched (``<path>.saving`` has no marker, or is complete but not yet swapped in); between the two
renames, ``<path>.saving`` holds the new one with its marker and ``<path>.replaced`` the old one.
``committed_dir`` reads whichever is complete (the newer first), and the next save's ``recover``
puts it back at ``path``. ``path`` itself stays a plain DCP directory.

``verify`` checks, before a tensor is read: the marker is present, ``.metadata`` reads, every file
that ``.metadata`` points into exists and is long enough, and every file has the size the marker
recorded. The bytes of each record are checked against checksums summed while saving, in
``autopar.runtime.checksums``.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from autopar.errors import CheckpointError

MARKER = ".autopar-commit"
STAGING_SUFFIX = ".saving"
REPLACED_SUFFIX = ".replaced"
FORMAT = 1


def staging_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + STAGING_SUFFIX)


def replaced_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + REPLACED_SUFFIX)


def is_committed(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def recover(path: str | os.PathLike) -> None:
    """Rank 0, before a save: finish a swap that a killed save left half done, and delete what
    no checkpoint needs (a staging directory without a marker, a replaced one)."""
    path, staging, replaced = Path(path), staging_dir(path), replaced_dir(path)
    if not path.exists():
        for candidate in (staging, replaced):  # the newer first
            if is_committed(candidate):
                _move(candidate, path)
                _sync_dir(path.parent)
                break
    for leftover in (staging, replaced):
        if leftover.exists():
            shutil.rmtree(leftover)


def commit(path: str | os.PathLike, world_size: int) -> None:
    """Rank 0, once every rank's shards and DCP's ``.metadata`` are in the staging directory:
    write the marker and swap the staging directory in for ``path``."""
    path, staging, replaced = Path(path), staging_dir(path), replaced_dir(path)
    if not (staging / ".metadata").is_file():
        raise CheckpointError(f"the save into {staging} wrote no .metadata: the checkpoint at {path} is left as it was")
    files = {entry.name: entry.stat().st_size for entry in sorted(staging.iterdir()) if entry.is_file()}
    marker = {"format": FORMAT, "world_size": world_size, "torch_version": torch.__version__, "files": files}
    # The records' own checksums are in the side files (runtime.checksums); DCP's small index is summed here.
    marker["metadata_crc32"] = zlib.crc32((staging / ".metadata").read_bytes())
    with open(staging / MARKER, "w") as handle:
        json.dump(marker, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    _sync_dir(staging)
    if path.exists():
        _move(path, replaced)
    _move(staging, path)
    _sync_dir(path.parent)
    if replaced.exists():
        shutil.rmtree(replaced)


def committed_dir(path: str | os.PathLike) -> Path:
    """The complete checkpoint that ``path`` names: ``path`` itself, or, when a save was killed
    between its two renames, the staging or replaced directory that holds a complete one."""
    path = Path(path)
    if is_committed(path):
        return path
    if not path.exists():
        for candidate in (staging_dir(path), replaced_dir(path)):
            if is_committed(candidate):
                return candidate
        raise CheckpointError(
            f"no checkpoint at {path}: the directory does not exist; pass the directory that autopar.checkpoint.save wrote"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is a file, not a checkpoint directory: pass the directory that autopar.checkpoint.save wrote"
        )
    raise CheckpointError(
        f"the checkpoint at {path} has no commit marker ({MARKER}): its save did not finish, or another tool wrote it "
        "(autopar.checkpoint.save commits a checkpoint only once every rank has written it). Load a complete "
        "checkpoint, or pass verify=False to read a DCP checkpoint you trust as it is"
    )


def verify(path: str | os.PathLike, marked: bool = True) -> tuple[Path, Metadata]:
    """The directory to read and its DCP metadata, once the checkpoint is checked complete:
    every file ``.metadata`` points into is present and long enough (a CheckpointError naming
    the path, the files and the fix otherwise). ``marked=False`` skips the commit marker."""
    directory = committed_dir(path) if marked else Path(path)
    if not directory.is_dir():
        raise CheckpointError(
            f"no checkpoint at {directory}: not a directory; pass the directory that autopar.checkpoint.save wrote"
        )
    if not (directory / ".metadata").is_file():
        raise CheckpointError(
            f"the checkpoint at {directory} has no .metadata file: it is not a DCP checkpoint, or "
            "its save did not finish; load a complete checkpoint"
        )
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as error:  # a truncated or foreign file: pickle, EOF or attribute errors
        raise CheckpointError(
            f"the checkpoint's {directory / '.metadata'} cannot be read ({type(error).__name__}: "
            f"{error}): the file is damaged; load another checkpoint"
        ) from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, end in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size < end:
            problems.append(f"{name} holds {file.stat().st_size} bytes where .metadata reads up to byte {end}")
    if marked:
        problems += _marker_problems(directory, {problem.split(" ", 1)[0] for problem in problems})
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(
            f"the checkpoint at {directory} is damaged: {shown}. No tensor was loaded; restore "
            "these files or load another checkpoint"
        )
    return directory, metadata


def _marker_problems(directory: Path, known: set[str]) -> list[str]:
    """Files whose size differs from the one the commit marker recorded (beyond those in ``known``)."""
    try:
        recorded = json.loads((directory / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"the commit marker {MARKER} cannot be read"]
    problems = []
    for name, size in sorted(recorded.items()):
        file = directory / name
        if name in known:
            continue
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{name} holds {file.stat().st_size} bytes where {size} were saved")
    if not problems and not _metadata_sum_matches(directory):
        problems.append(".metadata differs from what was saved (checksum)")
    return problems


def _metadata_sum_matches(directory: Path) -> bool:
    """Whether ``.metadata`` sums to what the marker recorded (a marker without a sum: yes)."""
    try:
        saved = json.loads((directory / MARKER).read_text()).get("metadata_crc32")
    except (OSError, ValueError, AttributeError):
        return False
    return saved is None or zlib.crc32((directory / ".metadata").read_bytes()) == saved


def _move(source: Path, target: Path) -> None:
    """Rename within one directory: atomic on POSIX filesystems, so a kill leaves one or the other."""
    os.rename(source, target)


def _sync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the OS lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
