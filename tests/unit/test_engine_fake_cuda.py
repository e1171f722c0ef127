"""The GPU serving path's device placement, proven on this CPU-only machine with PyTorch's FakeTensorMode.

Under FakeTensorMode a tensor made on `cuda:0` needs no GPU, and any op that meets a CUDA and a CPU tensor raises
a device-mismatch error. The tiny backbone is bound to a segment on `cuda:0` the way a function binds the
daemon's (the segment planned from the store files by the daemon's loader, viewed as tensors, bound with
`bind_backbone`), a LoRA adapter is attached on `cuda:0`, and the engine runs prefill, decode, a join into a running
batch and a cancellation, up to its data-dependent boundary (`GenerationEngine._sample`, replaced here by a sampler
that checks the logits' device and picks a fixed token). Any tensor the runtime made on the CPU fails the test.
On a CPU-only torch, Python indexing of a fake CUDA tensor needs a CUDA device guard: `install_fake_cuda_guard`
registers c10's FakeGuardImpl (a C++ compiler builds it once; cached afterwards).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from lorafaas.backbone_daemon.loader import plan_direct_load
from lorafaas.cuda_ipc.layout import DEFAULT_ALIGNMENT, plan_layout, tensor_views
from lorafaas.cuda_ipc.messages import CudaVmmLocation, SegmentManifest
from lorafaas.function_runtime.engine import GenerationEngine
from lorafaas.function_runtime.instance import load_tokenizer
from lorafaas.function_runtime.messages import SamplingParams
from lorafaas.models.binding import bind_backbone, build_empty_model
from lorafaas.models.lora import LoraLinear, attach_adapter, read_host_adapter
from lorafaas.testing.fake_cuda import fake_cuda_mode, install_fake_cuda_guard
from lorafaas.testing.tiny_models import save_tiny_adapter

DEVICE = torch.device("cuda:0")
SAMPLED_TOKEN = 17  # what the fake sampler picks: a token that is no EOS of the tiny tokenizer

# torch 2.13 names the error FakeTensorDeviceMismatchError; torch 2.11 (the GPU machine's) raises a plain RuntimeError
DEVICE_MISMATCH = getattr(fake_tensor, "FakeTensorDeviceMismatchError", RuntimeError)


class FakeCudaAttachment:
    """An attacher's side of a segment on cuda:0, as the CUDA VMM transport gives it, made of fake tensors."""

    def __init__(self, entries, size: int) -> None:
        self.device = "cuda:0"
        self.size = size
        location = CudaVmmLocation(device_uuid="GPU-fake", allocation_size=size)
        self.manifest = SegmentManifest(device=self.device, location=location, size=size,
                                        alignment=DEFAULT_ALIGNMENT, tensors=tuple(entries))
        self.base = torch.empty(size, dtype=torch.uint8, device=DEVICE)
        self.base_ptr = 0
        self.tensors = tensor_views(self.base, entries)

    def contains(self, tensor: torch.Tensor) -> bool:  # fake tensors have no data pointer: compare storages
        return tensor.device == DEVICE and tensor.untyped_storage()._cdata == self.base.untyped_storage()._cdata


class DeviceCheckingEngine(GenerationEngine):
    """The engine with its sampling boundary replaced: the logits must be on the model's device."""

    def _sample(self, logits: torch.Tensor, seq) -> int:
        assert logits.device == DEVICE, f"logits of {seq.request_id} on {logits.device}"
        return SAMPLED_TOKEN


@pytest.fixture(scope="module", autouse=True)
def fake_cuda_guard() -> None:
    if not torch.backends.cuda.is_built() and shutil.which("c++") is None:
        pytest.skip("a C++ compiler is needed to register the fake CUDA device guard (apt-get install g++)")
    install_fake_cuda_guard()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_dense_dir: Path) -> Path:
    return save_tiny_adapter(tmp_path_factory.mktemp("fake-cuda-adapter"), tiny_dense_dir, seed=5, rank=4)


def test_the_fake_mode_refuses_a_cpu_tensor_meeting_a_cuda_one() -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = torch.ones(3, device=DEVICE)
        with pytest.raises(DEVICE_MISMATCH):
            torch.cat([on_gpu, torch.ones(3)])


def test_bind_attach_prefill_decode_join_and_cancel_stay_on_cuda(tiny_dense_dir: Path, adapter_dir: Path) -> None:
    plan = plan_direct_load(tiny_dense_dir, sorted(tiny_dense_dir.glob("*.safetensors")))
    entries, size = plan_layout(plan.specs)
    tokenizer = load_tokenizer(tiny_dense_dir)
    adapter = read_host_adapter(adapter_dir)  # host memory, as the adapter stage reads it
    empty = build_empty_model(tiny_dense_dir)
    with fake_cuda_mode():
        attachment = FakeCudaAttachment(entries, size)
        model = bind_backbone(attachment, tiny_dense_dir, model=empty)
        assert {t.device for t in (*model.parameters(), *model.buffers())} == {DEVICE}
        assert attach_adapter(model, adapter, "cuda:0") == adapter.num_bytes
        lora = [m for m in model.modules() if isinstance(m, LoraLinear) and m.lora_a is not None]
        assert lora and all(m.lora_a.device == m.lora_b.device == DEVICE for m in lora)

        engine = DeviceCheckingEngine(model, tokenizer)
        assert engine.device == DEVICE
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.add("a", [5, 6, 7, 8, 9], params)
        engine.add("b", [11, 12], params)
        outputs = engine.step()  # prefill of both (left-padded), each gets its first token, both join the batch
        assert [o.token_id for o in outputs] == [SAMPLED_TOKEN] * 2
        engine.add("c", [3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
        outputs = engine.step()  # a decode step of a and b, then c prefilled and joined into the running batch
        assert {o.request_id for o in outputs} == {"a", "b", "c"} and engine.num_running == 3
        for tensor in (engine._mask, engine._positions, engine._next_input):
            assert tensor.device == DEVICE
        assert all(layer.keys.device == DEVICE for layer in engine._cache.layers)
        engine.cancel("b")
        finished = {}
        while engine.has_work():  # cancellation, then c and a finish by length: rows leave the batch
            for output in engine.step():
                if output.finish_reason is not None:
                    finished[output.request_id] = output.finish_reason
        assert finished == {"b": "cancelled", "c": "length", "a": "length"}
