"""Validating an adapter against a stored backbone: its file headers and the backbone's module tree (no weights).

An adapter is accepted when it names this backbone (or no backbone) and `rules.check_against_model` accepts it on
the backbone built on the meta device, the same check a worker runs on its bound model before attaching it, and its
weights are finite. Expert adapters (lorafaas's MoE format) are checked against the backbone's linear layers, read
off its safetensors header (every 2-D `<module>.weight` is a layer of shape [out_features, in_features]).
"""

from __future__ import annotations

import logging
from pathlib import Path

from lorafaas.errors import AdapterIncompatible, AdapterInvalid, AdapterUnsupported
from lorafaas.formats.adapter_files import WEIGHTS_FILE, AdapterInfo, read_adapter
from lorafaas.formats.adapter_rules import MAX_FLOAT32, ModuleTable, check_against_model
from lorafaas.formats.expert_adapters import (
    EXPERTS_KEY,
    ExpertAdapterInfo,
    check_expert_adapter,
    read_expert_adapter_info,
)
from lorafaas.formats.model_store import NAME_PATTERN, BackboneManifest, ModelStore
from lorafaas.formats.weights import DTYPE_SIZES, read_safetensors_header
from lorafaas.models.module_table_process import module_table_of

log = logging.getLogger(__name__)


def backbone_linear_layers(store: ModelStore, manifest: BackboneManifest) -> dict[str, tuple[int, int]]:
    """Module path -> (out_features, in_features) for every 2-D weight of the backbone."""
    layers: dict[str, tuple[int, int]] = {}
    for weight_file in manifest.weight_files:
        header = read_safetensors_header(store.path(manifest.name) / weight_file)
        for name, info in header.tensors.items():
            if name.endswith(".weight") and len(info.shape) == 2:
                layers[name.removesuffix(".weight")] = (info.shape[0], info.shape[1])
    if "lm_head" not in layers and "model.embed_tokens" in layers:  # tied output embedding
        layers["lm_head"] = layers["model.embed_tokens"]
    return layers


def known_names(manifest: BackboneManifest, store: ModelStore) -> set[str]:
    """The names an adapter's base_model_name_or_path may give: the backbone's, its store path, the ids it is known
    by, and the store path of each stored backbone among them (a converted copy, `backbone convert`, keeps its
    source's name: an adapter trained on the source's store path is for the copy too)."""
    sources = [n for n in manifest.base_model_ids if NAME_PATTERN.fullmatch(n) and store.exists(n)]
    names = (manifest.name, str(store.path(manifest.name)), *manifest.base_model_ids,
             *(str(store.path(n)) for n in sources))
    return {n.lower() for n in names}


def validate_adapter(path: Path, store: ModelStore, backbone: str) -> AdapterInfo:
    """Return the adapter's info if it can run on `backbone`; raise AdapterInvalid/AdapterIncompatible otherwise."""
    info = read_adapter(path)
    manifest = store.get(backbone)
    if info.base_model and info.base_model.lower() not in known_names(manifest, store):
        also = f" (also known as {', '.join(manifest.base_model_ids)})" if manifest.base_model_ids else ""
        raise AdapterIncompatible(
            f"adapter {info.path} was trained on base model {info.base_model!r}, but backbone {backbone!r}{also} "
            "is a different model"
        )
    if EXPERTS_KEY not in info.config:
        check_against_model(info.config, info.layout, backbone_module_table(store.path(manifest.name)), backbone)
        _check_finite(info)
        return info
    # An expert adapter: its per-expert layers come from the backbone's MoE layout.
    _check_expert_fields(info)
    layers = backbone_linear_layers(store, manifest)
    layers.update(check_expert_adapter(info.path, store.path(manifest.name), backbone))
    _check_targets(info, layers, backbone)
    for module in info.modules:
        if module.path not in layers:
            raise AdapterIncompatible(f"adapter layer {module.path} does not exist in backbone {backbone!r}")
        out_features, in_features = layers[module.path]
        if (module.in_features, module.out_features) != (in_features, out_features):
            raise AdapterIncompatible(
                f"shape mismatch at {module.path}: the adapter maps {module.in_features} -> {module.out_features} "
                f"features, but backbone {backbone!r} has {in_features} -> {out_features} there"
            )
    _check_finite(info)
    return info


def backbone_module_table(model_dir: Path) -> ModuleTable:
    """The backbone's module tree as PEFT's matching sees it, from the model built on the meta device (in a child
    process, once per backbone: this process need not import torch)."""
    return module_table_of(model_dir)


def warm_up(store: ModelStore) -> None:
    """Build each stored backbone's module table before the gateway serves, so that the first upload does not wait
    for it (built in a child process: the gateway imports neither torch nor transformers)."""
    for manifest in store.list():
        try:
            backbone_module_table(store.path(manifest.name))
        except Exception as exc:  # a backbone that cannot be built is refused at deploy with its own message
            log.warning("warming up the adapter checks for backbone %s: %s", manifest.name, exc)


def _check_expert_fields(info: AdapterInfo) -> None:
    """Expert adapters are lorafaas's own format: plain LoRA pairs only."""
    for name in ("modules_to_save", "lora_bias", "exclude_modules", "layers_to_transform"):
        if info.config.get(name) not in (None, False, [], {}):
            raise AdapterUnsupported(f"adapter_config.json: {name} is not supported for expert adapters")
    if info.layout.saved:
        raise AdapterUnsupported("adapter_config.json: modules_to_save is not supported for expert adapters")


def _check_targets(info: AdapterInfo, layers: dict[str, tuple[int, int]], backbone: str) -> None:
    targets = info.target_modules
    if isinstance(targets, str):
        if not any(info.layout.patterns.fullmatch("target_modules", targets, path) for path in layers):
            raise AdapterIncompatible(f"target_modules regex {targets!r} matches no layer of backbone {backbone!r}")
        return
    leaf_names = {path.rsplit(".", 1)[-1] for path in layers}
    unknown = [t for t in targets if t not in leaf_names and not any(p.endswith("." + t) for p in layers)]
    if unknown:
        raise AdapterIncompatible(
            f"unknown target module(s) {', '.join(map(repr, unknown))}: no such layer in backbone {backbone!r} "
            f"(its linear layers are {', '.join(sorted(leaf_names))})"
        )


# A float is NaN or infinite when its exponent bits are all ones (float8 e4m3 has no infinity: all ones is NaN).
_NON_FINITE_MASKS = {"F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80),
                     "F8_E5M2": ("u1", 0x7C), "F8_E4M3": ("u1", 0x7F)}
_CHUNK_ELEMENTS = 1 << 22  # the check's scratch stays a few MB whatever the adapter's size


def _check_finite(info: AdapterInfo) -> None:
    """Refuse NaN and infinite weights (and float64 ones beyond float32), reading the file's bits with numpy: the
    gateway's process does not import torch."""
    import numpy as np

    path = info.path / WEIGHTS_FILE
    header = read_safetensors_header(path)
    file_bytes = None  # one map of the file for all its tensors (an all-linear adapter has hundreds)
    for name, tensor in header.tensors.items():
        if tensor.dtype not in _NON_FINITE_MASKS and tensor.dtype != "F64":
            continue
        count = tensor.num_bytes // DTYPE_SIZES[tensor.dtype]
        if count == 0:
            continue
        kind, mask = _NON_FINITE_MASKS.get(tensor.dtype, ("<f8", 0))
        if file_bytes is None:
            file_bytes = np.memmap(path, dtype=np.uint8, mode="r")
        begin = header.data_offset + tensor.begin
        values = file_bytes[begin:begin + count * DTYPE_SIZES[tensor.dtype]].view(kind)
        for start in range(0, count, _CHUNK_ELEMENTS):
            chunk = values[start:start + _CHUNK_ELEMENTS]
            if tensor.dtype == "F64":
                if not np.isfinite(chunk).all():
                    raise AdapterInvalid(f"{WEIGHTS_FILE}: tensor {name} contains NaN or infinite values")
                if (np.abs(chunk) > MAX_FLOAT32).any():
                    raise AdapterInvalid(f"{WEIGHTS_FILE}: tensor {name} holds values float32 cannot hold")
            elif ((chunk & mask) == mask).any():
                raise AdapterInvalid(f"{WEIGHTS_FILE}: tensor {name} contains NaN or infinite values")
    del file_bytes


def validate_expert_adapter(path: Path, store, backbone: str) -> ExpertAdapterInfo:
    """Everything `validate_adapter` checks (which covers the expert sets and shapes), and the adapter's info."""
    validate_adapter(path, store, backbone)
    return read_expert_adapter_info(path)
