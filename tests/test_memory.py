import time

import psutil
import torch

from recurformer.memory import PeakMemory


def test_the_peak_includes_memory_freed_before_the_block_ends():
    process = psutil.Process()
    with PeakMemory(interval=0.01) as memory:
        before = process.memory_info().rss
        block = torch.ones(16 * 2**20)  # 64 MiB, written, so resident
        time.sleep(0.1)
        del block
    assert memory.peak >= before + 60 * 2**20
    assert memory.peak >= process.memory_info().rss
