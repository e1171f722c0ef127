"""What a hostile tenant sends (issue 18), built without torch: archives and adapters for tests and `bench edge`."""

from __future__ import annotations

import gzip
import json
import tarfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from lorafaas.platform.adapter_upload import pack_adapter

BOUNDARY = "edge-boundary"
REDOS_TARGETS = "model\\.layers\\.1\\.(?:.|.|.)*!"  # catastrophic backtracking in a naive fullmatch


def multipart_head(name: str, backbone: str) -> bytes:
    """A deploy's multipart body up to the adapter's bytes (boundary `BOUNDARY`); the caller sends the rest."""
    spec = json.dumps({"name": name, "backbone": backbone})
    return (
        f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"spec\"\r\n\r\n{spec}\r\n"
        f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"adapter\"; filename=\"a.tar.gz\"\r\n"
        "Content-Type: application/gzip\r\n\r\n"
    ).encode()


def tar_of_folders(count: int) -> bytes:
    """A gzipped tar of `count` empty directory members (small to send, costly to walk). Headers are made from one
    template (name and checksum patched), as tarfile would take ~20 s for 200,000 of them."""
    template = bytearray(tarfile.TarInfo("d").tobuf(format=tarfile.USTAR_FORMAT))
    template[156:157] = tarfile.DIRTYPE
    template[0:100] = bytes(100)
    template[148:156] = b" " * 8
    base_sum = sum(template)
    before, after = bytes(template[100:148]), bytes(template[156:])
    members = []
    for i in range(count):
        name = f"d{i}/".encode()
        members.append(name.ljust(100, b"\0") + before + b"%06o\0 " % (base_sum + sum(name)) + after)
    return gzip.compress(b"".join(members) + b"\0" * 1024, compresslevel=1)


def zero_adapter(out_dir: Path, backbone_dir: Path, *, rank: int, base_model_name: str,
                 target_modules: list[str] | str | None = None, num_layers: int | None = None) -> Path:
    """A PEFT LoRA adapter of zeros on q_proj and v_proj (a few KB as a .tgz however large it unpacks)."""
    config = json.loads((Path(backbone_dir) / "config.json").read_text())
    hidden = config["hidden_size"]
    kv = hidden // config["num_attention_heads"] * config.get("num_key_value_heads", config["num_attention_heads"])
    layers = range(num_layers if num_layers is not None else config["num_hidden_layers"])
    tensors = {}
    for i in layers:
        for module, out_features in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.zeros((rank, hidden), dtype=np.float16)
            tensors[f"{prefix}.lora_B.weight"] = np.zeros((out_features, rank), dtype=np.float16)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
        "target_modules": target_modules if target_modules is not None else ["q_proj", "v_proj"],
        "base_model_name_or_path": base_model_name,
    }))
    return out_dir


def redos_adapter(out_dir: Path, backbone_dir: Path, base_model_name: str) -> Path:
    """A valid rank-4 adapter whose target_modules regex backtracks catastrophically on a long module path."""
    return zero_adapter(out_dir, backbone_dir, rank=4, base_model_name=base_model_name, target_modules=REDOS_TARGETS)


def truncated(adapter_dir: Path) -> bytes:
    archive = pack_adapter(adapter_dir)
    return archive[: len(archive) // 2]
