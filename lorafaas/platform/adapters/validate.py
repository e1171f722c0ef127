"""Validating an adapter against a stored backbone, from file headers alone (no model is built).

The backbone's linear layers are read off its safetensors header: every 2-D `<module>.weight` tensor is a layer of
shape [out_features, in_features]. An adapter is accepted when it names this backbone (or no backbone), its target
modules exist, and every LoRA pair fits the layer it attaches to, with finite weights.
"""

from __future__ import annotations

import re
from pathlib import Path

from lorafaas.errors import AdapterIncompatible, AdapterInvalid
from lorafaas.platform.adapters.expert_adapters import EXPERTS_KEY, check_expert_adapter
from lorafaas.platform.adapters.files import WEIGHTS_FILE, AdapterInfo, read_adapter
from lorafaas.platform.model_store import BackboneManifest, ModelStore
from lorafaas.weights import read_safetensors_header


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
    return {n.lower() for n in (manifest.name, str(store.path(manifest.name)), *manifest.base_model_ids)}


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
    layers = backbone_linear_layers(store, manifest)
    if EXPERTS_KEY in info.config:  # an expert adapter: its per-expert layers come from the backbone's MoE layout
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


def _check_targets(info: AdapterInfo, layers: dict[str, tuple[int, int]], backbone: str) -> None:
    targets = info.target_modules
    if isinstance(targets, str):
        if not any(re.fullmatch(targets, path) for path in layers):
            raise AdapterIncompatible(f"target_modules regex {targets!r} matches no layer of backbone {backbone!r}")
        return
    leaf_names = {path.rsplit(".", 1)[-1] for path in layers}
    unknown = [t for t in targets if t not in leaf_names and not any(p.endswith("." + t) for p in layers)]
    if unknown:
        raise AdapterIncompatible(
            f"unknown target module(s) {', '.join(map(repr, unknown))}: no such layer in backbone {backbone!r} "
            f"(its linear layers are {', '.join(sorted(leaf_names))})"
        )


def _check_finite(info: AdapterInfo) -> None:
    import torch
    from safetensors.torch import load_file

    for name, tensor in load_file(info.path / WEIGHTS_FILE).items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise AdapterInvalid(f"{info.path / WEIGHTS_FILE}: tensor {name} contains NaN or infinite values")
