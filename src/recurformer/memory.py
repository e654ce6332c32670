"""Peak resident memory of a block of work, sampled from a background thread."""

from __future__ import annotations

import threading

import psutil


class PeakMemory:
    """`with PeakMemory() as memory: work()`, then `memory.peak`: the largest resident set
    size (bytes) of this process seen while the block ran, sampled every `interval` seconds
    and at its start and end. A peak shorter than the interval can be missed."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.peak = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def _sample(self) -> None:
        self.peak = max(self.peak, self._process.memory_info().rss)

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "PeakMemory":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
