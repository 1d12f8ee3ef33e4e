"""Where offloaded tensors live: pinned host memory, or files on local disk.

Both stores hold whole tensors under string keys and hand back *fresh* tensors on the compute
device: the caller owns what ``get`` returns and drops it when done, so nothing of the store
stays resident on the device between uses. ``prefetch(key)`` starts reading ``key`` on a
background thread; the next ``get(key)`` takes that read instead of starting one. ``put(...,
wait=False)`` writes behind on the same thread, which keeps reads and writes of a key in order.

A store also carries casts (``keep_cast``): under a precision policy an offloaded parameter's
master (fp32) is what the optimizer steps, and a copy in the compute dtype (bf16) is what the
graph reads. Every ``put`` of the master rewrites that copy (cast where the value is, on the
device), so no writer (the optimizer, compile, a checkpoint load) can leave it stale, and a fetch
moves half the bytes of the master.

``DiskStore`` keeps one file per key, read and written with ``os.preadv`` / ``os.pwrite``
into and out of ordinary tensors. It never maps a file: mapped pages count in the process's
resident memory while they are mapped, and on a machine whose compute device is the host, the
point of disk offload (ZeRO-Infinity's NVMe offload) is that they do not.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from autopar.cost.cluster import LinkSpec
from autopar.ops.params import local_of

# Writes a store keeps in flight behind the caller (each holds its tensor until written).
MAX_WRITES_BEHIND = 2


def cast_key(key: str, dtype: torch.dtype) -> str:
    """The key of ``key``'s copy in ``dtype`` (``Store.keep_cast``)."""
    return f"{key}@{str(dtype).removeprefix('torch.')}"


class Store:
    """The common part: shapes and dtypes by key, and one background thread for prefetch."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._pending: dict[str, Future] = {}
        self._writes: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-offload")
        # On a GPU every copy runs on a stream of the store's own (``_on_side_stream``), so that a
        # prefetch or a write behind overlaps the compute stream instead of queueing on it.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.bytes_read = 0
        self.bytes_written = 0
        self._casts: dict[str, set[torch.dtype]] = {}  # key -> the dtypes of its copies (keep_cast)
        self._handed: dict[str, tuple[weakref.ref, int]] = {}  # key -> a copy handed out, its version then

    def __contains__(self, key: str) -> bool:
        return key in self.meta

    def put(self, key: str, tensor: torch.Tensor, wait: bool = True) -> None:
        """Store ``tensor``'s value under ``key``. ``wait=False`` writes behind, on the store's
        thread: the caller hands ``tensor`` over and must not change it (at most
        ``MAX_WRITES_BEHIND`` writes are in flight; a read of ``key`` waits for its write)."""
        self._drop_pending(key)
        self._wait_write(key)
        tensor = tensor.detach()
        self.meta[key] = (tensor.shape, tensor.dtype)
        self.bytes_written += tensor.numel() * tensor.element_size()
        ready = None
        if self._stream is not None:  # the kernels that made it, on the caller's stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        if wait:
            self._write_after(key, tensor, ready)
        else:
            while len(self._writes) >= MAX_WRITES_BEHIND:
                self._wait_write(next(iter(self._writes)))
            self._writes[key] = self._pool.submit(self._write_after, key, tensor, ready)
        for dtype in self._casts.get(key, ()):  # cast here, where the value is: the copy moves fewer bytes
            self.put(cast_key(key, dtype), tensor.to(dtype), wait)

    def hand_out(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (or a DTensor over it), a copy of ``key``'s value given to the user (an
        offloaded parameter in ``pm.state_dict()``), recorded without keeping it alive, so that
        what is later written into it in place (``dcp.load(pm.state_dict(), ...)``) comes back to
        the store (``take_back``), as it would reach a resident parameter through their storage."""
        self._handed[key] = (weakref.ref(tensor), local_of(tensor)._version)
        return tensor

    def take_back(self) -> None:
        """Put back every handed-out copy written in place since it was handed out; forget the
        copies no one holds any more. The module calls this before it reads the store anew
        (each forward, the optimizer's step, a state dict)."""
        for key, (ref, version) in list(self._handed.items()):
            tensor = ref()
            if tensor is None:
                del self._handed[key]
            elif local_of(tensor)._version != version:
                self.put(key, local_of(tensor))
                self._handed[key] = (ref, local_of(tensor)._version)

    def keep_cast(self, key: str, dtype: torch.dtype) -> str:
        """Keep a copy of ``key`` in ``dtype``, rewritten by every later ``put`` of ``key``, and
        return its key (``cast_key``). A key that holds a value already is copied now."""
        copies = self._casts.setdefault(key, set())
        if dtype not in copies:
            copies.add(dtype)
            if key in self.meta:
                self.put(cast_key(key, dtype), self.get(key).to(dtype))
        return cast_key(key, dtype)

    def _write_after(self, key: str, tensor: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        with self._on_side_stream(ready):
            self._write(key, tensor)  # holds ``tensor`` until its copy is done

    @contextlib.contextmanager
    def _on_side_stream(self, ready: torch.cuda.Event | None = None):
        """Run the copies inside on the store's stream, after ``ready``, and wait for them (on
        this thread only: the compute stream goes on). Nothing on a CPU."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            yield
        self._stream.synchronize()

    def get(self, key: str) -> torch.Tensor:
        """A fresh tensor on the compute device holding ``key``'s value."""
        with self._lock:
            future = self._pending.pop(key, None)
        if future is not None:
            return self._handed_over(future.result())
        self._wait_write(key)
        return self._handed_over(self._load(key))

    def get_on_host(self, key: str) -> torch.Tensor:
        """A fresh tensor in host memory holding ``key``'s value, read without passing through
        the device: a state dict's copy of an offloaded tensor, which the device may have no room
        for (the plan offloaded it because it does not fit there). ``get`` on a host device."""
        with self._lock:
            future = self._pending.pop(key, None)
        if future is not None:  # a prefetch already read it onto the device
            return future.result().to("cpu")
        self._wait_write(key)
        shape, dtype = self.meta[key]
        out = self._read_on_host(key, shape, dtype)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def _handed_over(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, read on the store's stream, now used on the caller's: its memory must not
        go back to the store's stream while the caller's kernels may still read it."""
        if self._stream is not None and tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(self.device))
        return tensor

    def _wait_write(self, key: str) -> None:
        future = self._writes.pop(key, None)
        if future is not None:
            future.result()

    def flush(self) -> None:
        """Wait for every write behind."""
        for key in list(self._writes):
            self._wait_write(key)

    def prefetch(self, key: str) -> None:
        with self._lock:
            if key in self._pending or key not in self.meta:
                return
            self._pending[key] = self._pool.submit(self._load, key)

    def accumulate(self, key: str, tensor: torch.Tensor, wait: bool = True) -> None:
        """``key += tensor``, or store ``tensor`` if ``key`` holds nothing yet."""
        if key in self.meta:
            total = self.get(key)
            total += tensor.detach()
            self.put(key, total, wait)
        else:
            self.put(key, tensor, wait)

    def delete(self, key: str) -> None:
        self._drop_pending(key)
        self._wait_write(key)
        self.meta.pop(key, None)
        for dtype in self._casts.pop(key, ()):
            self.delete(cast_key(key, dtype))

    def _drop_pending(self, key: str) -> None:
        with self._lock:
            future = self._pending.pop(key, None)
        if future is not None:
            future.result()  # a read in flight must not land after this write

    def _load(self, key: str) -> torch.Tensor:
        shape, dtype = self.meta[key]
        with self._on_side_stream():
            out = self._read(key, shape, dtype)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def _write(self, key: str, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def _read(self, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _read_on_host(self, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)


class HostStore(Store):
    """Host memory: pinned where the compute device is a GPU, so copies run asynchronously."""

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(device)
        self._pin = self.device.type == "cuda"
        self._tensors: dict[str, torch.Tensor] = {}

    def _write(self, key: str, tensor: torch.Tensor) -> None:
        held = self._tensors.get(key)
        if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
            held = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
            self._tensors[key] = held
        held.copy_(tensor, non_blocking=self._pin)
        if self._pin:
            torch.cuda.current_stream(self.device).synchronize()

    def _read(self, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return self._tensors[key].to(self.device, non_blocking=self._pin, copy=True)

    def _read_on_host(self, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype).copy_(self._tensors[key])  # pageable: it may live long

    def delete(self, key: str) -> None:
        super().delete(key)
        self._tensors.pop(key, None)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def return_freed_memory_to_os(threshold_bytes: int = 1 << 20) -> bool:
    """Make glibc serve allocations of ``threshold_bytes`` and more by mmap, so that freeing
    them returns the memory to the OS. By default glibc raises that threshold after the first
    large free, up to 32 MiB, and keeps later frees below it in its heap, where they still count
    as resident. Offload on a host device streams many such buffers through memory and lowers
    resident memory only if they go back. Returns False where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):
        return False


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _aligned_bytes(num_bytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``num_bytes`` rounded up to ``DIRECT_ALIGN``, at an aligned address."""
    padded = -(-max(num_bytes, 1) // DIRECT_ALIGN) * DIRECT_ALIGN
    raw = torch.empty(padded + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % DIRECT_ALIGN
    return raw[start : start + padded]


DIRECT_ALIGN = 4096  # O_DIRECT wants buffer addresses, sizes and file offsets in whole blocks
_BOUNCE_BYTES = 4 << 20  # writes of unaligned tensors go through an aligned buffer this size


class DiskStore(Store):
    """One file per key under ``path`` (a temporary directory, removed on ``close``, if None).

    Files are opened with ``O_DIRECT`` where the file system takes it, as ZeRO-Infinity's NVMe
    offload does: reads and writes then go to the device, not the page cache, so the offloaded
    bytes leave this machine's memory (with buffered I/O they would stay there as cache), and a
    read waits on the disk, not on a CPU copy, so it overlaps compute. ``direct=False`` (or a
    file system without O_DIRECT, such as tmpfs) uses buffered I/O. On a host device the store
    also calls ``return_freed_memory_to_os``."""

    def __init__(self, path: str | os.PathLike | None = None, device: torch.device | str = "cpu", direct: bool = True):
        super().__init__(device)
        if self.device.type == "cpu":
            return_freed_memory_to_os()
        self._owned = path is None
        self.path = tempfile.mkdtemp(prefix="autopar-offload-") if path is None else os.fspath(path)
        made_dir = self._owned or not os.path.isdir(self.path)
        os.makedirs(self.path, exist_ok=True)
        self._fds: dict[str, int] = {}
        self._files: list[str] = []  # the files this store created, removed on close
        self.direct = direct and hasattr(os, "O_DIRECT")
        # Runs on close, on garbage collection or at interpreter exit, whichever comes first, so
        # no run (an example, a killed script) leaves its offload files behind.
        self._cleanup = weakref.finalize(self, _remove_files, self.path, self._fds, self._files, made_dir)

    def _fd(self, key: str) -> int:
        fd = self._fds.get(key)
        if fd is None:
            name = os.path.join(self.path, key.replace("/", "__"))
            if not os.path.exists(name):
                self._files.append(name)
            flags = os.O_RDWR | os.O_CREAT
            if self.direct:
                try:
                    fd = os.open(name, flags | os.O_DIRECT, 0o600)
                except OSError:  # EINVAL: this file system has no O_DIRECT
                    self.direct = False
            if fd is None:
                fd = os.open(name, flags, 0o600)
            self._fds[key] = fd
        return fd

    def _write(self, key: str, tensor: torch.Tensor) -> None:
        data = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        fd = self._fd(key)
        if not self.direct:
            _pwrite_all(fd, memoryview(data.numpy()), 0)
            return
        bounce = _aligned_bytes(min(data.numel(), _BOUNCE_BYTES))
        for offset in range(0, data.numel(), bounce.numel()):
            chunk = data[offset : offset + bounce.numel()]
            bounce[: chunk.numel()].copy_(chunk)
            size = -(-chunk.numel() // DIRECT_ALIGN) * DIRECT_ALIGN
            _pwrite_all(fd, memoryview(bounce[:size].numpy()), offset)

    def _read(self, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        pin = self.device.type == "cuda"
        out = self._read_on_host(key, shape, dtype, pin)
        return out.to(self.device, non_blocking=pin) if self.device.type != "cpu" else out

    def _read_on_host(self, key: str, shape: torch.Size, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        num_bytes = math.prod(shape) * dtype.itemsize
        fd = self._fd(key)
        if self.direct:
            buffer = _aligned_bytes(num_bytes, pin)
            out = buffer[:num_bytes].view(dtype).view(shape)
        else:
            out = torch.empty(shape, dtype=dtype, pin_memory=pin)
            buffer = out.reshape(-1).view(torch.uint8)
        view, offset = memoryview(buffer.numpy()), 0
        while offset < num_bytes:
            got = os.preadv(fd, [view[offset:]], offset)
            if got <= 0:
                raise OSError(f"offload file for {key!r} in {self.path} is shorter than its tensor")
            offset += got
        return out

    def delete(self, key: str) -> None:
        super().delete(key)
        fd = self._fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        super().close()
        self._cleanup()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _remove_files(path: str, fds: dict[str, int], files: list[str], made_dir: bool) -> None:
    """Close a DiskStore's files and remove those it created, and its directory if it made it
    (a temporary one, or a ``disk:PATH`` that did not exist) and nothing else is left in it."""
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
    for name in files:
        with contextlib.suppress(OSError):
            os.remove(name)
    files.clear()
    if made_dir:
        try:
            os.rmdir(path)
        except OSError:  # not empty: files that are not ours
            pass


def measure_disk_link(path: str | os.PathLike, size_bytes: int = 128 << 20):
    """A ``LinkSpec`` for ``DiskStore`` under ``path``, measured as the store moves data: one
    write and one read of ``size_bytes`` through ``os.pwrite`` / ``os.preadv``. The bandwidth is
    the harmonic mean of the two (an offloaded byte is written once and read once)."""
    import time

    store = DiskStore(os.path.join(os.fspath(path), "measure"))
    value = torch.ones(size_bytes // 4)
    start = time.perf_counter()
    store.put("probe", value)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    store.get("probe")
    read_s = time.perf_counter() - start
    small = torch.ones(1)
    start = time.perf_counter()
    for _ in range(20):
        store.put("latency", small)
        store.get("latency")
    latency_s = (time.perf_counter() - start) / 40
    store.close()
    shutil.rmtree(os.path.join(os.fspath(path), "measure"), ignore_errors=True)
    return LinkSpec(latency_s=latency_s, bandwidth_bytes_per_s=2 * size_bytes / (write_s + read_s))


def make_store(target: str, path: str | None, device: torch.device | str) -> Store:
    """The store for a plan's offload ``target`` ("cpu" or "disk"; ``path`` for disk)."""
    if target == "disk":
        return DiskStore(path, device)
    return HostStore(device)


__all__ = ["cast_key", "Store", "HostStore", "DiskStore", "make_store", "return_freed_memory_to_os", "measure_disk_link"]
