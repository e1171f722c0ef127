"""The ctypes layer over libcuda, as far as it can be checked without a GPU: struct layouts as the CUDA 12 headers
define them, and the refusals a machine without a driver gives (a clear error, never a crash)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from lorafaas import cuda_ipc
from lorafaas.cuda_ipc import cuda_driver
from lorafaas.errors import InvalidInput, TransportUnavailable
from lorafaas.platform.server import parse_devices


def test_struct_layouts_match_the_cuda_headers() -> None:
    # cuda.h: CUmemLocation {int type; int id}; CUmemAllocationProp {type, requestedHandleTypes, location,
    # void *win32HandleMetaData, allocFlags {uchar, uchar, ushort, uchar[4]}}; CUmemAccessDesc {location, flags}
    assert ctypes.sizeof(cuda_driver.CUmemLocation) == 8
    assert ctypes.sizeof(cuda_driver.CUmemAllocationProp) == 32
    assert cuda_driver.CUmemAllocationProp.win32HandleMetaData.offset == 16
    assert cuda_driver.CUmemAllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(cuda_driver.CUmemAccessDesc) == 12
    assert ctypes.sizeof(cuda_driver.CUuuid) == 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the refusals do not apply")
def test_without_a_driver_cuda_devices_are_refused_clearly() -> None:
    with pytest.raises(TransportUnavailable, match="cuda:0"):
        cuda_ipc.check_transport("cuda:0")
    with pytest.raises(InvalidInput, match=r"cuda:0=20G"):  # no budget given and none can be read from the GPU
        parse_devices("cuda:0")
    assert parse_devices("cuda:0=2G")[0].budget_bytes == 2 * 1024**3
