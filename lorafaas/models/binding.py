"""Binding a transformers model to a shared backbone segment, without copying a byte of it.

    model = build_empty_model(model_dir)             # parameters on the meta device: no memory, ~20-50 ms
    model = bind_backbone(attachment, model_dir, model=model)

`bind_backbone` assigns each tensor of the segment as the module's parameter (persistent buffers alike), ties tied
weights (lm_head to embed_tokens) to the one shared tensor, computes the buffers that are not in a checkpoint (rotary
`inv_freq`: the module is rebuilt on the real device, so they are computed exactly as `from_pretrained` computes them)
and then checks that nothing is left on the meta device and that every parameter's bytes lie inside the segment.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafaas.cuda_ipc import Attachment
from lorafaas.errors import BindingFailed

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)
_NO_INIT_LOCK = threading.Lock()


def build_empty_model(model_dir: Path):
    """The model of a store entry (or any HF directory) built on the meta device, in eval mode; no weights read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    # initialising meta tensors is pure overhead (half the time). no_init_weights swaps torch.nn.init's functions
    # process-wide and puts back what it found: two threads overlapping in it would leave the no-ops in place for
    # good (every later random init in the process a no-op), hence the lock.
    with _NO_INIT_LOCK, torch.device("meta"), _no_init_weights():
        model = AutoModelForCausalLM.from_config(config)
    if (model_dir / "generation_config.json").is_file():  # as from_pretrained does, for generate()
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model.eval()


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        return contextlib.nullcontext()
    return no_init_weights()


def bind_backbone(attachment: Attachment, model_dir: Path, *, model: nn.Module | None = None):
    """Return the model of `model_dir` whose parameters are the attached shared segment's tensors.

    `model`, if given, is an empty model from `build_empty_model`. Raises BindingFailed if the segment does not fit
    the model or anything would end up outside the segment.
    """
    if model is None:
        model = build_empty_model(model_dir)
    _assign(model, attachment.tensors)
    _tie_weights(model, set(attachment.tensors))
    _materialize_computed_buffers(model, attachment.device)
    check_bound(model, attachment)
    _compute_from_packed(model, attachment)
    contiguous_head_input(model)
    model._lorafaas_attachment = attachment  # keeps the mapping's owner alive as long as the model
    return model


def _assign(model: nn.Module, tensors: dict) -> None:
    import torch

    modules = dict(model.named_modules())
    for name, tensor in tensors.items():
        module_name, _, attr = name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise BindingFailed(f"the segment holds {name!r} but the model has no module {module_name!r}")
        current = module._parameters.get(attr)
        if current is None:
            current = module._buffers.get(attr)
            if current is None:
                raise BindingFailed(f"the segment holds {name!r} but the model has no such parameter or buffer")
            if current.shape != tensor.shape:
                raise BindingFailed(f"buffer {name!r} is {tuple(current.shape)} in the model, {tuple(tensor.shape)} "
                                    "in the segment")
            module._buffers[attr] = tensor
            continue
        if current.shape != tensor.shape:
            raise BindingFailed(
                f"parameter {name!r} is {tuple(current.shape)} in the model but {tuple(tensor.shape)} in the segment; "
                "the segment holds another backbone"
            )
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)


def tied_weight_keys(model: nn.Module) -> dict[str, str]:
    """{target: source} of the parameters the model's config ties (e.g. lm_head.weight -> embed_tokens.weight)."""
    hf: Any = model  # a transformers model (nn.Module's __getattr__ types its methods as Tensor | Module)
    if hasattr(hf, "get_expanded_tied_weights_keys"):
        return dict(hf.get_expanded_tied_weights_keys(all_submodels=True))
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


def _tie_weights(model: nn.Module, present: set[str]) -> None:
    """Point each tied parameter missing from the segment at the one present (either direction, as transformers)."""
    if not hasattr(model, "get_expanded_tied_weights_keys") and not hasattr(model, "all_tied_weights_keys"):
        hf: Any = model  # a transformers model
        hf.tie_weights()  # transformers 4: ties the output embeddings to the input embeddings per the config
        return
    for target, source in tied_weight_keys(model).items():
        if source in present and target not in present:
            _set_parameter(model, target, model.get_parameter(source))
        elif target in present and source not in present:
            _set_parameter(model, source, model.get_parameter(target))


def contiguous_head_input(model: nn.Module) -> None:
    """Give the LM head an input torch's matmul can fold into one matrix. transformers computes the logits from
    `hidden_states[:, -1:, :]`, a strided view. With parameters that need no gradient (bound ones), matmul does not
    fold that view. It runs a batched product over an expanded weight instead, which in bf16 on a CPU is a plain loop:
    157 ms against 5 ms for SmolLM2's head at one thread, two thirds of a 48-token prefill (float32: 6.5 against
    5.2 ms, MKL's batched product)."""
    hf: Any = model  # a transformers model
    head = hf.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(_contiguous_first_argument)


def _contiguous_first_argument(module: nn.Module, args: tuple):
    first = args[0] if args else None
    if first is None or not hasattr(first, "stride") or _foldable(first):
        return None
    import torch

    # a copy with the strides of its shape: `contiguous()` returns the view itself, which counts as contiguous (its
    # dimensions of size 1 are ignored) though matmul's fold test reads the strides
    return (first.clone(memory_format=torch.contiguous_format), *args[1:])


def _foldable(tensor) -> bool:
    """Whether torch's matmul can view `tensor` as one matrix (its leading dimensions' strides nest)."""
    return all(tensor.stride(i) == tensor.stride(i + 1) * tensor.shape[i + 1] for i in range(tensor.dim() - 2))


def _compute_from_packed(model: nn.Module, attachment: Attachment) -> None:
    """Make each linear layer whose weight the segment holds packed for oneDNN a `PackedLinear` computing from it
    (lorafaas/models/packed_weights.py); raise BindingFailed if any other module holds a packed weight's bytes (it
    would read them as values)."""
    if not any(entry.onednn_md is not None for entry in attachment.manifest.tensors):
        return
    import torch

    from lorafaas.errors import SegmentError
    from lorafaas.models.cpu_linear import PackedLinear
    from lorafaas.models.packed_weights import packed_views

    try:
        views = packed_views(attachment)
    except SegmentError as exc:
        raise BindingFailed(str(exc)) from exc
    carriers = {attachment.tensors[name].data_ptr(): name for name in views}
    for path_of, module in model.named_modules():
        for attr, tensor in module.named_parameters(recurse=False):
            name = carriers.get(tensor.data_ptr())
            if name is None:
                continue
            if type(module) is not torch.nn.Linear or attr != "weight" or f"{path_of}.weight" != name:
                raise BindingFailed(f"{path_of}.{attr} holds the weight {name!r}, which the segment stores packed for "
                                    "oneDNN; only that weight's own linear layer can compute from it")
            module.__class__ = PackedLinear
            module.packed = views[name]


def _set_parameter(model: nn.Module, name: str, parameter) -> None:
    module_name, _, attr = name.rpartition(".")
    model.get_submodule(module_name)._parameters[attr] = parameter


def _materialize_computed_buffers(model: nn.Module, device: str) -> None:
    """Rebuild, on `device`, each module whose buffers are computed at construction and so still on meta."""
    import torch

    for module_name, module in list(model.named_modules()):
        if not any(b is not None and b.is_meta for b in module._buffers.values()):
            continue
        config = getattr(module, "config", None)
        if config is None or any(p.is_meta for p in module.parameters(recurse=False)):
            names = [f"{module_name}.{n}" for n, b in module._buffers.items() if b is not None and b.is_meta]
            raise BindingFailed(f"buffers {names} are neither in the segment nor computable from the config")
        cls = type(module)
        kwargs = {"device": device} if "device" in inspect.signature(cls.__init__).parameters else {}
        with torch.device(device):
            rebuilt = cls(config, **kwargs)
        parent_name, _, child = module_name.rpartition(".")
        model.get_submodule(parent_name)._modules[child] = rebuilt


def check_bound(model: nn.Module, attachment: Attachment) -> None:
    """Raise BindingFailed unless no tensor is on meta and every parameter's bytes lie inside the segment."""
    on_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if on_meta:
        raise BindingFailed(f"{len(on_meta)} tensor(s) of the bound model are still on the meta device: {on_meta[:5]}")
    outside = [n for n, p in model.named_parameters() if not attachment.contains(p)]
    if outside:
        raise BindingFailed(
            f"{len(outside)} parameter(s) lie outside the shared segment [{attachment.base_ptr:#x}, "
            f"+{attachment.size}): {outside[:5]}"
        )
