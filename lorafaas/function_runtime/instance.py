"""A function instance's staged loading: each artifact loaded (and unloaded) as its own timed step.

    libraries -> backbone (bound through the daemon) -> adapter (host memory, then on the device) -> warmup

An expert adapter (MoE backbones, `moe_lora.py`) keeps its attention part here and runs its expert LoRA here
(`lora_mode` local) or on the node's LoRA server (remote, the default).

The node agent orders the steps one at a time (pre-loading); a request arriving early runs whatever is missing (a
cold start), and the timings of each step are kept as that cold start's breakdown. Every method here blocks; the
worker runs them on its single compute thread.
"""

from __future__ import annotations

import importlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafaas.errors import InvalidInput
from lorafaas.function_runtime.messages import AdapterStats, StageName, UnstageName, WorkerSpec

if TYPE_CHECKING:  # imported by the stages that need them (a cold start pays for torch once, in `libraries`)
    import torch
    from torch import nn
    from typing_extensions import TypeIs

    from lorafaas.function_runtime.base_pass import BasePassClient
    from lorafaas.function_runtime.engine import GenerationEngine
    from lorafaas.models.lora import HostAdapter
    from lorafaas.models.moe_lora import MoeAdapter

log = logging.getLogger(__name__)

# What the `libraries` stage imports; the zygote imports the same before forking.
LIBRARY_MODULES = (
    "torch",
    "safetensors.torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral",
    "tokenizers",
    "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_utils_tokenizers",
    "transformers.convert_slow_tokenizer",
    "lorafaas.models.lora",
    "lorafaas.function_runtime.engine",
    "lorafaas.models.binding",
)
REQUIRED_STAGES: tuple[StageName, ...] = ("libraries", "backbone", "adapter")
WARMUP_TOKENS = 8
PLAIN_WARMUP_TOKENS = 32  # a pool process's dummy prompt: as long as a typical first prompt's prefill


def import_libraries() -> None:
    for module in LIBRARY_MODULES:
        importlib.import_module(module)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class FunctionInstance:
    def __init__(self, spec: WorkerSpec, tokenizer=None) -> None:
        """`tokenizer`: the backbone's tokenizer if the library pool already holds it (inherited over fork)."""
        self.spec = spec
        self._pool_tokenizer = tokenizer
        self.loaded: list[StageName] = []
        self.stage_seconds: dict[str, float] = {}
        self.model: nn.Module | None = None
        self.tokenizer: Any = None  # a transformers tokenizer
        self.host_adapter: HostAdapter | MoeAdapter | None = None
        self.engine: GenerationEngine | None = None
        # while the backbone's linear layers go to the shared base pass
        self.base_pass: BasePassClient | None = None
        self._lease_id: str | None = None
        self._segment_tensors: dict[str, torch.Tensor] | None = None  # the attached backbone's, for the base pass

    @property
    def ready(self) -> bool:
        """Can serve a request now: warm-up is an optional pre-load (the first request warms up otherwise)."""
        return {"libraries", "backbone", "adapter"} <= set(self.loaded)

    def load(self, stage: StageName) -> float:
        """Run one step (its prerequisites must be loaded); returns its seconds. Loading a loaded step is a no-op."""
        if stage in self.loaded:
            return 0.0
        missing = [s for s in _prerequisites(stage, adapter_first="adapter" in self.loaded) if s not in self.loaded]
        if missing:
            raise InvalidInput(f"stage {stage!r} needs {', '.join(missing)} loaded first")
        started = time.perf_counter()
        getattr(self, f"_load_{stage}")()
        seconds = time.perf_counter() - started
        self.loaded.append(stage)
        self.stage_seconds[stage] = seconds
        log.info("%s/%s: %s loaded in %.1f ms", self.spec.function, self.spec.instance_id, stage, seconds * 1e3)
        return seconds

    def load_for_request(self) -> dict[str, float]:
        """Load every missing step a request needs, in order (a cold start); returns their seconds."""
        ran: dict[str, float] = {stage: self.load(stage) for stage in REQUIRED_STAGES if stage not in self.loaded}
        if self.engine is None:
            self.engine = self._new_engine()
        return ran

    def unload(self, stage: UnstageName) -> float:
        """Undo a step: offload the adapter to host memory, drop it, or unbind the backbone."""
        if self.engine is not None and self.engine.has_work():
            raise InvalidInput(f"cannot {stage} while the instance serves {self.engine.num_running} request(s)")
        started = time.perf_counter()
        if stage in ("adapter_offload", "adapter_drop") and self.model is not None:
            self._detach_adapter()
        # A remote-mode expert adapter has no host copy worth keeping (the LoRA server holds its experts): offloading
        # releases its connection and buffer too, and reloading reconnects.
        if stage == "adapter_drop" or (stage == "adapter_offload" and self._adapter_kind() == "remote"):
            self._release_host_adapter()
        if stage == "backbone":
            self._unbind()
        else:  # the host copy, if kept, makes reloading the adapter a placement only
            self.loaded = [s for s in self.loaded if s != "adapter"]
        seconds = time.perf_counter() - started
        log.info("%s/%s: %s done in %.1f ms", self.spec.function, self.spec.instance_id, stage, seconds * 1e3)
        return seconds

    # -- the steps -------------------------------------------------------------------------------------------------

    def _load_libraries(self) -> None:
        import_libraries()
        import torch

        if self.spec.num_threads:
            torch.set_num_threads(self.spec.num_threads)

    def _load_backbone(self) -> None:
        model_dir = Path(self.spec.model_dir)
        if self.spec.daemon_socket:
            from lorafaas.models.binding import bind_backbone
            from lorafaas.protocols.daemon_client import DaemonClient

            with DaemonClient.connect(Path(self.spec.daemon_socket), client=self.spec.instance_id) as daemon:
                attached = daemon.attach(self.spec.function)
            self._lease_id = attached.lease_id
            attachment = attached.map()
            model = bind_backbone(attachment, model_dir)  # the sealed segment, read-only; the fd closed
            self.model = model
            if attached.backbone.cpu_linear == "onednn":  # the daemon measured it faster here
                from lorafaas.models.cpu_linear import use_onednn_linears

                use_onednn_linears(model)
            self._segment_tensors = attachment.tensors
            if self.spec.base_pass:
                self._join_base_pass(model, attachment.tensors, self.spec.base_pass)
        else:
            from lorafaas.models.reference import load_backbone

            self.model, _ = load_backbone(model_dir)
        self.tokenizer = self._pool_tokenizer or load_tokenizer(model_dir)
        if self.host_adapter is not None:  # read into host memory before the backbone arrived: place it now
            self._place_adapter()

    def _load_adapter(self) -> None:
        if self.spec.adapter_dir and self.host_adapter is None:
            self.host_adapter = self._read_adapter(Path(self.spec.adapter_dir))
        if self.model is not None:
            self._place_adapter()

    def _read_adapter(self, adapter_dir: Path) -> HostAdapter | MoeAdapter:
        """A dense adapter into host memory, or an expert adapter opened in the spec's LoRA mode (`MoeAdapter`:
        its attention part here, its experts here or on the LoRA server)."""
        from lorafaas.formats.expert_adapters import is_expert_adapter

        if is_expert_adapter(adapter_dir):
            from lorafaas.models.moe_lora import open_moe_adapter

            return open_moe_adapter(
                adapter_dir,
                self.spec.lora_mode,
                lora_server=self.spec.lora_server,
                client=self.spec.instance_id,
                device=self.spec.device,
            )
        from lorafaas.models.lora import read_host_adapter

        return read_host_adapter(adapter_dir)

    def adapter_stats(self) -> AdapterStats | None:
        adapter = self.host_adapter
        if adapter is None:
            return None
        if _is_dense(adapter):
            return AdapterStats(kind="dense", held_bytes=adapter.num_bytes)
        info = adapter.info
        return AdapterStats(
            kind="experts", lora_mode=adapter.mode, held_bytes=adapter.held_bytes, expert_bytes=info.expert_bytes
        )

    def _adapter_kind(self) -> str | None:
        """None (no adapter), "dense", or an expert adapter's mode ("local" | "remote")."""
        return None if self.host_adapter is None else _kind_of(self.host_adapter)

    def _load_warmup(self) -> None:
        from lorafaas.function_runtime.messages import SamplingParams

        if self.engine is None:
            self.engine = self._new_engine()
        engine = self.engine
        # One prefill and one decode step, so kernels, thread pools and allocators are ready for the first request.
        engine.add("warmup", list(range(1, 1 + WARMUP_TOKENS)), SamplingParams(max_tokens=2))
        while engine.has_work():
            engine.step()

    def warm_up_plain(self) -> None:
        """A pool process's warm-up, before it serves any function: one prefill of a dummy prompt and one decode
        step on the bare backbone, in an engine dropped afterwards (nothing of it stays but created kernels, started
        thread pools and faulted-in pages)."""
        from lorafaas.function_runtime.messages import SamplingParams

        engine = self._new_engine()
        engine.add("warmup", list(range(1, 1 + PLAIN_WARMUP_TOKENS)), SamplingParams(max_tokens=2))
        while engine.has_work():
            engine.step()

    def assign(self, spec: WorkerSpec) -> None:
        """A pool process becomes `spec`'s instance (once: `standby.py`); its adapter is read by the adapter stage.
        The spec's shared base pass is joined here, as a worker forked for it joins at its backbone stage."""
        if self.host_adapter is not None or "adapter" in self.loaded:
            raise InvalidInput("this process holds an adapter already; a process serves one function")
        self.spec = spec
        if spec.base_pass and self.model is not None and self._segment_tensors is not None:
            self._join_base_pass(self.model, self._segment_tensors, spec.base_pass)

    def _new_engine(self) -> GenerationEngine:
        from lorafaas.function_runtime.engine import EngineConfig, GenerationEngine

        config = EngineConfig(max_batch_size=self.spec.max_batch_size)
        return GenerationEngine(self._bound_model(), self.tokenizer, config, base_pass=self.base_pass)

    # -- undoing -------------------------------------------------------------------------------------------------

    def _place_adapter(self) -> None:
        from lorafaas.models.lora import attach_adapter

        adapter = self.host_adapter
        if adapter is None:
            self._detach_adapter()
        elif _is_dense(adapter):
            attach_adapter(self._bound_model(), adapter, self.spec.device)
        else:
            from lorafaas.models.moe_lora import install_expert_lora

            install_expert_lora(self._bound_model(), adapter.source, adapter.info)
            attach_adapter(self._bound_model(), adapter.attention, self.spec.device)

    def _detach_adapter(self) -> None:
        from lorafaas.models.lora import detach_adapter

        model = self._bound_model()
        detach_adapter(model)
        if self.host_adapter is not None and not _is_dense(self.host_adapter):
            from lorafaas.models.moe_lora import remove_expert_lora

            remove_expert_lora(model)

    def _release_host_adapter(self) -> None:
        """Forget the host copy; an expert adapter closes its source: local factors freed, or the server connection
        and its shared-memory buffer closed (the protocol has no unregister: the server's cache evicts the adapter
        when others need the room)."""
        adapter, self.host_adapter = self.host_adapter, None
        if adapter is not None and not _is_dense(adapter):
            adapter.close()

    def _join_base_pass(self, model: nn.Module, tensors: dict[str, torch.Tensor], path: str) -> None:
        from lorafaas.function_runtime.base_pass import BasePassUnavailable, install

        try:  # the engine hands this client to each decode step (`GenerationEngine.base_pass`)
            self.base_pass = install(model, tensors, path)
        except BasePassUnavailable as exc:  # slower alone, never wrong
            log.warning("%s/%s: %s; computing every layer here", self.spec.function, self.spec.instance_id, exc)

    def _bound_model(self) -> nn.Module:
        if self.model is None:
            raise InvalidInput(f"{self.spec.function}/{self.spec.instance_id}: the backbone is not loaded")
        return self.model

    def _unbind(self) -> None:
        if self.base_pass is not None:
            self.base_pass.close()
            self.base_pass = None
        self.model = self.tokenizer = self.engine = self._segment_tensors = None
        if self._lease_id and self.spec.daemon_socket:
            from lorafaas.protocols.daemon_client import DaemonClient

            with DaemonClient.connect(Path(self.spec.daemon_socket), client=self.spec.instance_id) as daemon:
                daemon.detach(self._lease_id)
            self._lease_id = None
        self.loaded = [s for s in self.loaded if s not in ("backbone", "warmup")]


def _is_dense(adapter: HostAdapter | MoeAdapter) -> TypeIs[HostAdapter]:
    return _kind_of(adapter) == "dense"


def _kind_of(adapter: HostAdapter | MoeAdapter) -> str:
    """`dense` for a HostAdapter, the mode of a MoeAdapter (checked without importing moe_lora and torch)."""
    return getattr(adapter, "mode", "dense")


def _prerequisites(stage: StageName, adapter_first: bool) -> tuple[StageName, ...]:
    """libraries -> {backbone, adapter} in either order -> warmup (which needs both)."""
    if stage == "libraries":
        return ()
    if stage in ("backbone", "adapter"):
        return ("libraries",)
    return ("libraries", "backbone", "adapter")
