"""Resident memory of a block of work: its peak, sampled from a background thread."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import threading

import psutil
import torch


@functools.cache
def _libc():
    """The C library, looked up once (`find_library` runs external tools); None if absent."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def release_freed_memory() -> None:
    """Collect the garbage, then hand freed heap pages back to the OS (glibc's `malloc_trim`; a
    no-op elsewhere), so the resident set size counts live memory: glibc keeps freed tensors'
    pages resident for reuse."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class PeakMemory:
    """`with PeakMemory() as memory: work()`, then `memory.peak`: the largest resident set
    size (bytes) of this process seen while the block ran, sampled every `interval` seconds
    and at its start and end (a peak shorter than the interval can be missed), and
    `memory.growth`: that peak above the resident size at the start. `settle` first collects
    garbage and returns freed pages to the OS, so that the start counts live memory only."""

    def __init__(self, interval: float = 0.05, settle: bool = False):
        self.interval, self.settle = interval, settle
        self.start = self.peak = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    @property
    def growth(self) -> int:
        return self.peak - self.start

    def _sample(self) -> None:
        self.peak = max(self.peak, self._process.memory_info().rss)

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "PeakMemory":
        if self.settle:
            release_freed_memory()
        self.start = self._process.memory_info().rss
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


class GpuPeakMemory:
    """`PeakMemory` for a CUDA device: `memory.peak`, the most bytes the caching allocator
    had allocated on `device` while the block ran (exact, not sampled), and `memory.growth`,
    that peak above what was allocated at its start."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.start = self.peak = 0

    @property
    def growth(self) -> int:
        return self.peak - self.start

    def __enter__(self) -> "GpuPeakMemory":
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device)


def peak_memory(device, interval: float = 0.05, settle: bool = False):
    """The peak-memory meter for `device`: `GpuPeakMemory` on a GPU, else `PeakMemory`."""
    return GpuPeakMemory(device) if torch.device(device).type == "cuda" else PeakMemory(interval, settle)
