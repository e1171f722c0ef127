"""A CPU backbone's linear weights stored in the segment in oneDNN's blocked layout, in place of the plain one.

oneDNN computes a product from a plain row-major weight by copying it into its blocked layout first, on every call:
at the eight rows of a shared-base round that copy costs a quarter of the time (`lorafaas bench products`, SmolLM2 in
float32 on two threads: 45 ms a round from the plain layout, 35 ms from the blocked one, against a 20 ms streaming
read of the same bytes; docs/performance.md, "Packed weights in the segment"). So the daemon repacks each linear
weight in the segment once, when it loads the backbone (`pack_in_place`, before the seal), and the segment holds only
that layout: no copy beside it, in the daemon or in any function.

The packed bytes take exactly the plain weight's place (a weight whose blocked layout would need padding stays
plain), and the entry of the segment's manifest carries oneDNN's serialized memory descriptor
(`TensorEntry.onednn_md`). An attacher makes oneDNN tensors over those pages (`packed_views`, no copy) and computes
from them (`PackedLinear`); the entry's plain view stays the parameter the model holds, for its shape, dtype and
address, but its bytes are no longer the weight's values in order. `bind_backbone` therefore makes every module
that holds a packed weight a `PackedLinear` and refuses a model in which anything else would read one.

oneDNN tensors over memory torch does not own are made through PyTorch's C shim for compiled models
(`aoti_torch_create_tensor_from_blob_v2`, what AOTInductor uses for its packed constants); a torch without it, or
without oneDNN, loads the plain layout (`packing_available`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import msgspec
import torch

from lorafaas import cuda_ipc
from lorafaas.cuda_ipc.layout import PACKABLE_DTYPES
from lorafaas.errors import SegmentError

log = logging.getLogger(__name__)
PACK_ROWS = 8  # the rows oneDNN picks its blocking for: a round of eight one-row functions (any count computes)


@functools.cache
def _shim() -> Any | None:
    """libtorch's C shim with the functions `_view` calls, or None."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        create = lib.aoti_torch_create_tensor_from_blob_v2
        for name in ("aoti_torch_layout__mkldnn", "aoti_torch_device_type_cpu", "aoti_torch_dtype_float32",
                     "aoti_torch_dtype_bfloat16"):
            getattr(lib, name).restype = ctypes.c_int32
    except (OSError, AttributeError):
        return None
    create.restype = ctypes.c_int32
    create.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64),
                       ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32, ctypes.c_char_p, ctypes.c_int64]
    return lib


def packing_available() -> bool:
    return (torch.backends.mkldnn.is_available() and _shim() is not None
            and hasattr(torch._C, "_aoti") and hasattr(torch._C._aoti, "alloc_tensor_by_stealing_from_void_ptr"))


def packable(dtype: str) -> bool:
    """Whether oneDNN computes weights of `dtype` natively here (a bf16 weight on a CPU without AVX-512 BF16 would
    be emulated: slower than the plain layout's kernel)."""
    if dtype not in PACKABLE_DTYPES or not packing_available():
        return False
    return dtype == "float32" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear_weight_names(model: torch.nn.Module, tied: Iterable[str]) -> set[str]:
    """The parameters that only a plain `nn.Linear` reads (a tied one, such as an LM head that is the embedding
    table, is read by an embedding lookup too, so it stays plain)."""
    tied_names = set(tied)
    return {f"{path}.weight" if path else "weight" for path, module in model.named_modules()
            if type(module) is torch.nn.Linear} - tied_names


def pack_in_place(segment: cuda_ipc.Export, names: Collection[str]) -> int:
    """Rewrite the weights `names` of the unsealed CPU `segment` in oneDNN's blocked layout and mark them in its
    manifest; returns how many were packed (a weight of another dtype or shape, or one that would need padding,
    stays plain)."""
    if segment.manifest.device != "cpu" or not names or not packing_available():
        return 0
    views = segment.writable_views()
    descriptors: dict[str, bytes] = {}
    with torch.inference_mode():
        for entry in segment.manifest.tensors:
            view = views[entry.name]
            if entry.name not in names or view.dim() != 2 or not packable(entry.dtype) or not view.numel():
                continue
            packed = torch.ops.mkldnn._reorder_linear_weight(view, PACK_ROWS)
            if torch.ops.mkldnn._nbytes(packed) != entry.nbytes:
                continue  # blocks padded past the plain bytes: this one stays plain
            ctypes.memmove(view.data_ptr(), torch.ops.mkldnn.data_ptr(packed), entry.nbytes)
            descriptors[entry.name] = torch.ops.mkldnn._get_mkldnn_serialized_md(packed).numpy().tobytes()
    del views
    mark_packed(segment, descriptors)
    return len(descriptors)


def mark_packed(segment: cuda_ipc.Export, descriptors: Mapping[str, bytes]) -> None:
    """Record in the unsealed `segment`'s manifest which of its weights are packed, by their oneDNN descriptors."""
    segment.manifest = msgspec.structs.replace(segment.manifest, tensors=tuple(
        msgspec.structs.replace(e, onednn_md=descriptors[e.name]) if e.name in descriptors else e
        for e in segment.manifest.tensors))


def packed_views(attachment: cuda_ipc.Attachment) -> dict[str, torch.Tensor]:
    """oneDNN tensors over the attached segment's packed weights, by name (none copied). Each keeps the plain view
    of its bytes alive, and with it the mapping. Raises SegmentError if one cannot be made or does not fit its
    entry."""
    entries = [e for e in attachment.manifest.tensors if e.onednn_md is not None]
    if not entries:
        return {}
    if attachment.device != "cpu" or not packing_available():
        raise SegmentError("the segment holds weights packed for oneDNN, which this process cannot compute from")
    return {e.name: _view(attachment.tensors[e.name], e) for e in entries}


def _view(carrier: torch.Tensor, entry: cuda_ipc.TensorEntry) -> torch.Tensor:
    lib = _shim()
    assert lib is not None and entry.onednn_md is not None
    dtypes = {torch.float32: lib.aoti_torch_dtype_float32(), torch.bfloat16: lib.aoti_torch_dtype_bfloat16()}
    shape = tuple(carrier.shape)
    sizes = (ctypes.c_int64 * 2)(*shape)
    strides = (ctypes.c_int64 * 2)(shape[1], 1)
    handle = ctypes.c_void_p()
    error = lib.aoti_torch_create_tensor_from_blob_v2(
        carrier.data_ptr(), 2, sizes, strides, 0, dtypes[carrier.dtype], lib.aoti_torch_device_type_cpu(), 0,
        ctypes.byref(handle), lib.aoti_torch_layout__mkldnn(), entry.onednn_md, len(entry.onednn_md))
    if error or not handle.value:
        raise SegmentError(f"oneDNN could not view the packed weight {entry.name!r} of the segment")
    capsule = _capsule(handle.value)
    view = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(capsule)  # type: ignore[arg-type]  # a capsule
    if view.shape != carrier.shape or view.dtype != carrier.dtype or \
            torch.ops.mkldnn._nbytes(view) != entry.nbytes or torch.ops.mkldnn.data_ptr(view) != carrier.data_ptr():
        raise SegmentError(f"the packed weight {entry.name!r} does not fit its place in the segment")
    view._lorafaas_carrier = carrier  # type: ignore[attr-defined]  # the mapping lives as long as the view
    return view


def _capsule(pointer: int) -> object:
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(pointer, None, None)
