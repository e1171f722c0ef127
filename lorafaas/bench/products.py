"""`lorafaas bench products`: one round of the shared base pass's products against a streaming read of the same
weights, per dtype and row count.

The round is what the daemon's executor computes for a decode step (`lorafaas.backbone_daemon.base_pass`): the first
group (layer 0's q/k/v) and every layer tail (o_proj, the MLP, the norms and the next layer's q/k/v, the LM head
last), through the executor's own `GroupWeights` (`lorafaas.backbone_daemon.group_weights`) on the executor's
threads and kernel, from the weights as the daemon lays them out by default: packed for oneDNN in the segment where
this torch can (`lorafaas.models.packed_weights`), else the plain layout with the daemon's measured float32 kernel
(`choose_cpu_linear`; `$LORAFAAS_CPU_LINEAR=torch|onednn` keeps it plain). A backbone without layer tails goes group by
group. The rows are seeded random values.

The bound: a read-only pass over the same tensors on every core (`streaming_read`: an integer max over each weight
viewed as integers of its element size, which reads each byte once and does one operation per element), in the
same run. Each repeat times the read, then the round, back to back; the ratio is the median of the repeats'
ratios, so a load that changes during the run cancels out of it as far as it can. Each dtype gets a segment of its own,
converted in memory where the backbone's dtype differs (as `lorafaas backbone convert --dtype bfloat16` would store it).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import torch

from lorafaas import cuda_ipc
from lorafaas.backbone_daemon.base_pass import executor_threads
from lorafaas.backbone_daemon.group_weights import GroupWeights, packs_bf16
from lorafaas.backbone_daemon.loader import execute_plan, plan_direct_load
from lorafaas.config import LorafaasConfig
from lorafaas.cuda_ipc.layout import dtype_name
from lorafaas.errors import InvalidInput
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.base_pass_groups import backbone_groups
from lorafaas.models.binding import bind_backbone
from lorafaas.models.cpu_linear import LINEAR_KERNELS, choose_cpu_linear
from lorafaas.models.packed_weights import pack_in_place, packed_views
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.protocols import base_pass as bp
from lorafaas.protocols.daemon_config import CPU_LINEAR_ENV, PACKING_SETTINGS, check_cpu_linear

DTYPES = ("float32", "bfloat16")
MAX_REPEATS = 100
STREAMING_METHOD = "integer max over each weight tensor (every byte read once), on {threads} thread(s)"
_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ProductsCase(msgspec.Struct, frozen=True, kw_only=True):
    dtype: str
    rows: int
    threads: int  # the executor's, for this dtype
    kernel: str  # "packed" (in the segment), "torch" or "onednn" (plain), or "onednn-packed-bf16" (a private copy)
    weight_bytes: int  # of the round's weights, each read once
    products_s: float  # median of the repeats
    streaming_s: float  # median of the repeats, on every core
    products_gb_s: float
    streaming_gb_s: float
    ratio_products_over_streaming: float  # median of the repeats' ratios


class ProductsBenchResult(msgspec.Struct, frozen=True, kw_only=True):
    backbone: str
    groups_per_round: int
    repeats: int
    streaming_method: str
    load_average: tuple[float, float]  # 1-minute load before and after the run
    cases: list[ProductsCase]


def parse_rows(text: str) -> tuple[int, ...]:
    """`--rows 1,2,4,8`; raises InvalidInput naming the bad value."""
    rows = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise InvalidInput(f"--rows has {part.strip()!r}; give row counts like 1,2,4,8") from None
        if not 1 <= value <= bp.MAX_ROWS:
            raise InvalidInput(f"--rows has {value}; a round has 1 to {bp.MAX_ROWS} rows")
        rows.append(value)
    return tuple(dict.fromkeys(rows))


def parse_dtypes(text: str) -> tuple[str, ...]:
    dtypes = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise InvalidInput(f"--dtype has {dtype!r}; choose from {', '.join(DTYPES)}")
    return dtypes


def round_keys(weights: GroupWeights) -> list[int]:
    """The groups one decode step's round computes, in order: fused through the layer tails where the backbone has
    them (the first group, then every tail), else every group."""
    if weights.has_tails:
        return [0, *range(weights.first_tail, weights.num_groups)]
    return list(range(weights.first_tail))


def round_weights(weights: GroupWeights, keys: list[int]) -> list[torch.Tensor]:
    """Each weight the round reads, once (a weight in two groups counts once)."""
    found: dict[int, torch.Tensor] = {}
    for key in keys:
        for weight in weights.weights_of(key):
            plain = getattr(weight, "_lorafaas_carrier", weight)  # a packed view's bytes, as a plain tensor
            found.setdefault(plain.data_ptr(), plain)
    return list(found.values())


def streaming_read(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        flat = tensor.reshape(-1)
        flat.view(_AS_INTEGERS[flat.element_size()]).amax()


def run_products_bench(home: Path, backbone: str, rows: tuple[int, ...], dtypes: tuple[str, ...], repeats: int,
                       progress: ProgressSink | None = None) -> ProductsBenchResult:
    """Raises InvalidInput for a bad option, BackboneNotFound for an unknown backbone."""
    progress = progress or SilentProgress()
    if not 1 <= repeats <= MAX_REPEATS:
        raise InvalidInput(f"--repeats is {repeats}; it must lie in [1, {MAX_REPEATS}]")
    if not rows or not dtypes:
        raise InvalidInput("give at least one row count and one dtype")
    store = ModelStore(LorafaasConfig(home=Path(home)).models_dir)
    manifest = store.get(backbone)
    model_dir = store.path(backbone)
    load_before = os.getloadavg()[0]
    cases: list[ProductsCase] = []
    groups_per_round = 0
    all_threads = os.cpu_count() or 1
    threads_before = torch.get_num_threads()
    progress.stage(f"loading {backbone}")
    plan = plan_direct_load(model_dir, [model_dir / f for f in manifest.weight_files])
    source = execute_plan(plan, "cpu", f"bench-products.{os.getpid()}")
    try:
        for dtype in dtypes:
            with _segment_in(source, getattr(torch, dtype), plan.linear_weights) as attachment, \
                    torch.inference_mode():
                tensors = attachment.tensors
                model = bind_backbone(attachment, model_dir)
                weights = _executor_weights({**tensors, **packed_views(attachment)}, backbone_groups(model, tensors))
                keys = round_keys(weights)
                groups_per_round = len(keys)
                read = round_weights(weights, keys)  # the segment's bytes (a packed copy holds as many)
                if packs_bf16():
                    weights.pack_if_bf16()  # as the executor does when its first member joins
                nbytes = sum(w.numel() * w.element_size() for w in read)
                threads = executor_threads(weights, all_threads) or all_threads
                progress.stage(f"{dtype}: {len(rows)} row counts x {repeats} repeats", len(rows))
                for count in rows:
                    products_s, streaming_s, ratio = _time_case(weights, keys, read, count, threads, all_threads,
                                                                repeats)
                    cases.append(ProductsCase(
                        dtype=dtype, rows=count, threads=threads, kernel=_kernel_name(weights), weight_bytes=nbytes,
                        products_s=products_s, streaming_s=streaming_s, products_gb_s=nbytes / products_s / 1e9,
                        streaming_gb_s=nbytes / streaming_s / 1e9, ratio_products_over_streaming=ratio))
                    progress.advance()
                del model, weights, read
    finally:
        torch.set_num_threads(threads_before)
        source.destroy()
    return ProductsBenchResult(backbone=backbone, groups_per_round=groups_per_round, repeats=repeats,
                               streaming_method=STREAMING_METHOD.format(threads=all_threads),
                               load_average=(load_before, os.getloadavg()[0]), cases=cases)


def _time_case(weights: GroupWeights, keys: list[int], read: list[torch.Tensor], rows: int, threads: int,
               all_threads: int, repeats: int) -> tuple[float, float, float]:
    generator = torch.Generator().manual_seed(rows)
    dtype = weights.dtype or torch.float32
    inputs = {key: torch.randn(rows, weights.in_width(key), generator=generator).to(dtype) for key in keys}

    def products() -> None:
        for key in keys:
            weights.compute(key, inputs[key])

    def streaming() -> None:
        streaming_read(read)

    products_times, streaming_times = [], []
    for repeat in range(repeats + 1):  # the first is a warm-up (oneDNN makes its primitives)
        streaming_s = _timed(streaming, all_threads)
        products_s = _timed(products, threads)
        if repeat:
            products_times.append(products_s)
            streaming_times.append(streaming_s)
    ratio = statistics.median(p / s for p, s in zip(products_times, streaming_times, strict=True))
    return statistics.median(products_times), statistics.median(streaming_times), ratio


def _timed(work: Callable[[], None], threads: int) -> float:
    torch.set_num_threads(threads)
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _cpu_linear_setting() -> str:
    setting = os.environ.get(CPU_LINEAR_ENV) or "auto"
    check_cpu_linear(setting, f"${CPU_LINEAR_ENV}")
    return setting


def _executor_weights(tensors: dict[str, torch.Tensor], groups: tuple[bp.GroupSpec, ...]) -> GroupWeights:
    """The weights and kernel the daemon's executor computes with (`Daemon._start_base_pass`): oneDNN's from packed
    weights, else its float32 choice (`$LORAFAAS_CPU_LINEAR` or measured)."""
    if any(t.is_mkldnn for t in tensors.values()):
        return GroupWeights(tensors, groups, LINEAR_KERNELS["onednn"])
    setting = _cpu_linear_setting()
    kernel = choose_cpu_linear("auto" if setting == "packed" else setting, list(tensors.values())).kernel
    return GroupWeights(tensors, groups, LINEAR_KERNELS[kernel])


def _kernel_name(weights: GroupWeights) -> str:
    if weights.packed:
        return "onednn-packed-bf16"
    if weights.dtype is not None and weights.layer(0)[0][0].is_mkldnn:
        return "packed"  # the segment's own layout (the daemon's default)
    return next(name for name, kernel in LINEAR_KERNELS.items() if kernel is weights.linear)


@contextlib.contextmanager
def _segment_in(source: cuda_ipc.Export, dtype: torch.dtype,
                linear_weights: frozenset[str]) -> Iterator[cuda_ipc.Attachment]:
    """The backbone in `dtype`, attached from a sealed copy of the loaded (plain) segment, converted where its dtype
    differs and its linear weights packed as the daemon packs them by default (`linear_weights`)."""
    assert source.fd is not None
    loaded = cuda_ipc.attach(source.manifest, source.fd)
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in loaded.tensors.items()}
    specs = [cuda_ipc.TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in state.items()]
    copy = cuda_ipc.create(specs, "cpu", name=f"bench-products.{os.getpid()}.{dtype}")
    attachment = None
    try:
        views = copy.writable_views()
        for name, tensor in state.items():
            views[name].copy_(tensor)
        del views, state
        loaded.close()
        if _cpu_linear_setting() in PACKING_SETTINGS:
            pack_in_place(copy, linear_weights)
        copy.seal()
        assert copy.fd is not None
        attachment = cuda_ipc.attach(copy.manifest, copy.fd)
        yield attachment
    finally:
        if attachment is not None:
            attachment.close()
        copy.destroy()
