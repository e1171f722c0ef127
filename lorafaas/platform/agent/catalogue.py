"""The sizes of the artifacts of the functions deployed here, read from disk once instead of on every view.

An adapter's bytes are read when its function is applied (`NodeAgent.apply`) and kept in the function's record
(`FunctionState.adapter_bytes`), so they go with it on delete and change with a redeploy of another adapter. A
backbone's bytes and KV bytes per token are read the first time a function of it needs them and kept while some
function deployed here uses it (`retain`). Building the scheduler's view (every plan tick, every offload decision)
then reads no file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from lorafaas.errors import AdapterNotFound
from lorafaas.formats.model_store import ModelStore

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class BackboneSizes:
    weight_bytes: int  # its weights, the copy a daemon holds per device
    kv_bytes_per_token: int  # K and V of every layer for one token, in the dtype it computes in


def compute_dtype_bytes(weight_dtypes: tuple[str, ...]) -> int:
    """Bytes of one element of the activations and KV cache of a backbone with weights of `weight_dtypes` (safetensors
    names): a 16-bit float where its matrices are (norms kept in float32 beside them do not change that), else 4."""
    return 2 if {"BF16", "F16"} & set(weight_dtypes) else 4


class ArtifactCatalogue:
    def __init__(self, store: Callable[[], ModelStore], adapter_path: Callable[[str], Path]) -> None:
        self._store = store  # the backend's model store, asked for when a backbone is first read
        self._adapter_path = adapter_path
        self._backbones: dict[str, BackboneSizes] = {}

    def adapter_bytes(self, digest: str) -> int:
        """The bytes of adapter `digest`'s weights, read now (when its function is applied). 0 for an adapter
        already gone (deleted or replaced meanwhile): never another request's error."""
        try:
            return (self._adapter_path(digest) / ADAPTER_WEIGHTS_FILE).stat().st_size
        except (AdapterNotFound, FileNotFoundError):
            log.info("adapter %s is gone; its size counts as 0", digest[:12])
            return 0

    def backbone(self, name: str) -> BackboneSizes:
        """`name`'s sizes, read from the store the first time they are asked for."""
        sizes = self._backbones.get(name)
        if sizes is None:
            store = self._store()
            manifest = store.get(name)
            config = json.loads((store.path(name) / "config.json").read_text())
            heads = config.get("num_attention_heads", 1)
            head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
            kv_heads = config.get("num_key_value_heads") or heads
            element = compute_dtype_bytes(manifest.dtypes)
            layers = config.get("num_hidden_layers", 1)
            sizes = BackboneSizes(manifest.bytes, 2 * layers * kv_heads * head_dim * element)
            self._backbones[name] = sizes
        return sizes

    def retain(self, backbones: Iterable[str]) -> None:
        """Forget every backbone but `backbones` (those the functions deployed here use)."""
        kept = set(backbones)
        for name in [n for n in self._backbones if n not in kept]:
            del self._backbones[name]

    def known_backbones(self) -> frozenset[str]:
        return frozenset(self._backbones)
