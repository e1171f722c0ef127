"""A process's PSS by what its mappings hold: the backbone segment apart from the process's own memory."""

from __future__ import annotations

import mmap
import os

from lorafaas.function_runtime.memory import read_memory, read_memory_parts

MB = 1024 * 1024


def test_a_lorafaas_memfd_counts_as_segment_and_anonymous_memory_as_heap() -> None:
    fd = os.memfd_create("lorafaas-test-segment", os.MFD_CLOEXEC)
    os.ftruncate(fd, 8 * MB)
    segment = mmap.mmap(fd, 8 * MB)
    try:
        before = read_memory_parts()
        segment.write(b"\1" * 8 * MB)  # every page touched: this process alone maps them, so all of it is its PSS
        heap = bytearray(b"\1" * 8 * MB)  # malloc's: a private anonymous mapping
        after = read_memory_parts()
        assert after.segment_bytes - before.segment_bytes == 8 * MB
        assert after.heap_bytes - before.heap_bytes >= 8 * MB
        assert after.own_bytes == after.pss_bytes - after.segment_bytes
        assert after.pss_bytes == after.segment_bytes + after.heap_bytes + after.libraries_bytes + after.other_bytes
        rollup = read_memory()  # the kernel's own sum, read a moment later: the same pages within a little
        assert abs(rollup.pss_bytes - after.pss_bytes) < 2 * MB
        del heap
    finally:
        segment.close()
        os.close(fd)
