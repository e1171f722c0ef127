"""A backbone stored in another dtype: `lorafaas backbone convert NAME --from SOURCE --dtype bfloat16`.

The copy is a store entry of its own. Its floating-point tensors are cast (rounded to nearest) and written as
safetensors, its config says the dtype, and it keeps the source's identity (the source's name and the ids its
adapters name), so the source's adapters deploy on it. The daemon serves it like any entry: the segment holds the
checkpoint's dtypes, and a function's activations follow the weights. bfloat16 halves the bytes a decode step reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lorafaas.errors import AlreadyExists, InvalidInput
from lorafaas.formats.model_store import MANIFEST_FILE, METADATA_SUFFIXES, BackboneManifest, ModelStore, check_name
from lorafaas.progress import ProgressSink, SilentProgress

DTYPES = ("bfloat16", "float16", "float32")


def convert_backbone(store: ModelStore, name: str, source_name: str, dtype: str,
                     progress: ProgressSink | None = None) -> tuple[BackboneManifest, bool]:
    """Store `source_name`'s weights in `dtype` as `name`; returns (manifest, created). Converting the same source
    to the same dtype again is a no-op; anything else under a taken name is refused."""
    progress = progress or SilentProgress()
    check_name(name)
    if dtype not in DTYPES:
        raise InvalidInput(f"--dtype is {dtype!r}; choose one of {', '.join(DTYPES)}")
    source = store.get(source_name)
    origin = f"convert:{source_name}@{source.short_hash}:{dtype}"
    if store.exists(name):
        existing = store.get(name)
        if existing.source == origin:
            return existing, False
        raise AlreadyExists(f"backbone {name!r} already exists (from {existing.source}); convert under another name")
    source_dir = store.path(source_name)
    with store.staging(name) as staging:
        for path in sorted(source_dir.iterdir()):
            if path.is_file() and path.suffix in METADATA_SUFFIXES and path.name not in (MANIFEST_FILE, "config.json"):
                shutil.copy2(path, staging / path.name)
        config = json.loads((source_dir / "config.json").read_text())
        config.pop("torch_dtype", None)  # transformers 5 reads `dtype`; an older key would contradict it
        config["dtype"] = dtype
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        progress.stage(f"casting {len(source.weight_files)} weight file(s) to {dtype}", source.bytes)
        for file_name in source.weight_files:
            _cast_file(source_dir / file_name, staging / file_name, dtype, progress)
        ids = tuple(dict.fromkeys((*source.base_model_ids, source_name)))
        return store.finalize(staging, name, source=origin, base_model_ids=ids, progress=progress), True


def _cast_file(src: Path, dst: Path, dtype: str, progress: ProgressSink) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = getattr(torch, dtype)
    tensors = {}
    with safe_open(src, framework="pt") as f:
        metadata = f.metadata()
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            tensor = f.get_tensor(key)
            progress.advance(tensor.numel() * tensor.element_size())
            tensors[key] = tensor.to(target).contiguous() if tensor.is_floating_point() else tensor
    save_file(tensors, dst, metadata=metadata)
