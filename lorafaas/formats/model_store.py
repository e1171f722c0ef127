"""The model store: backbones under `$LORAFAAS_HOME/models/NAME/` in Hugging Face layout.

Each entry holds config.json, safetensors weights, tokenizer files and `lorafaas.json`, a manifest with the content
hash of the weights. Imports are staged in a hidden directory beside the entry and renamed into place, so a failed or
interrupted import leaves nothing behind and a reader never sees half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from lorafaas.errors import AlreadyExists, BackboneNotFound, InvalidName, MalformedModel, PickledWeightsRefused
from lorafaas.formats.weights import pickled_files, read_safetensors_header
from lorafaas.progress import ProgressSink, SilentProgress

MANIFEST_FILE = "lorafaas.json"
MANIFEST_VERSION = 1
# A DNS label, so the same name is valid as a Kubernetes object name later.
NAME_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# What an import copies besides the weights: configs, tokenizer files, chat templates.
METADATA_SUFFIXES = (".json", ".txt", ".jinja", ".model")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
HASH_CHUNK_BYTES = 8 * 1024 * 1024


class BackboneManifest(msgspec.Struct, frozen=True, kw_only=True):
    format_version: int
    name: str
    architecture: str
    model_type: str
    num_parameters: int
    bytes: int
    dtypes: tuple[str, ...]
    weights_sha256: str
    weight_files: tuple[str, ...]
    source: str
    # Names the weights are known by elsewhere (a hub id, a config's _name_or_path); adapters naming one of these
    # as their base model are for this backbone.
    base_model_ids: tuple[str, ...]
    created_at: float

    @property
    def short_hash(self) -> str:
        return self.weights_sha256[:12]


def check_name(name: str, kind: str = "backbone") -> str:
    if not NAME_PATTERN.match(name):
        raise InvalidName(
            f"{kind} name {name!r} is invalid: use 1-63 lowercase letters, digits and '-', starting and ending "
            "with a letter or digit"
        )
    return name


class ModelStore:
    def __init__(self, models_dir: Path) -> None:
        self.models_dir = Path(models_dir)

    def path(self, name: str) -> Path:
        return self.models_dir / check_name(name)

    def exists(self, name: str) -> bool:
        return (self.path(name) / MANIFEST_FILE).is_file()

    def get(self, name: str) -> BackboneManifest:
        manifest_path = self.path(name) / MANIFEST_FILE
        if not manifest_path.is_file():
            known = ", ".join(m.name for m in self.list()) or "none"
            raise BackboneNotFound(
                f"backbone {name!r} is not in the store at {self.models_dir} (imported: {known}); "
                f"import it with `lorafaas backbone import {name}`"
            )
        return msgspec.json.decode(manifest_path.read_bytes(), type=BackboneManifest)

    def list(self) -> list[BackboneManifest]:
        if not self.models_dir.is_dir():
            return []
        return [
            msgspec.json.decode((entry / MANIFEST_FILE).read_bytes(), type=BackboneManifest)
            for entry in sorted(self.models_dir.iterdir())
            if not entry.name.startswith(".") and (entry / MANIFEST_FILE).is_file()
        ]

    def import_dir(
        self, name: str, source_dir: Path, progress: ProgressSink | None = None
    ) -> tuple[BackboneManifest, bool]:
        """Copy a local Hugging Face causal-LM directory into the store; returns (manifest, created).

        Re-importing identical weights under the same name is a no-op; different weights under a taken name are
        refused rather than overwritten.
        """
        progress = progress or SilentProgress()
        check_name(name)
        source_dir = Path(source_dir).expanduser()
        if not source_dir.is_dir():
            raise MalformedModel(f"{source_dir} is not a directory")
        config = read_model_config(source_dir)
        weight_files = find_weight_files(source_dir)
        if self.exists(name):
            existing = self.get(name)
            digest = hash_files(weight_files, progress)
            if digest == existing.weights_sha256:
                return existing, False
            raise AlreadyExists(
                f"backbone {name!r} already exists with different weights (sha256 {existing.short_hash}, "
                f"new {digest[:12]}); import under another name"
            )
        copied = [p for p in sorted(source_dir.iterdir()) if p.is_file() and p.suffix in METADATA_SUFFIXES]
        ids = tuple(dict.fromkeys(i for i in (*_recorded_ids(source_dir), config.get("_name_or_path"), source_dir.name)
                                  if i))
        with self.staging(name) as staging:
            for path in copied:
                shutil.copy2(path, staging / path.name)
            total = sum(p.stat().st_size for p in weight_files)
            progress.stage(f"copying {len(weight_files)} weight file(s)", total)
            for path in weight_files:
                _copy_with_progress(path, staging / path.name, progress)
            manifest = self.finalize(staging, name, source=f"dir:{source_dir.resolve()}", base_model_ids=ids,
                                     progress=progress)
        return manifest, True

    @contextmanager
    def staging(self, name: str) -> Iterator[Path]:
        """A scratch directory beside the store entry; removed unless `finalize` moved it into place."""
        self.models_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".incoming-{name}-", dir=self.models_dir))
        try:
            yield staging
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def finalize(
        self, staging: Path, name: str, *, source: str, base_model_ids: tuple[str, ...], progress: ProgressSink
    ) -> BackboneManifest:
        """Check the staged entry, write its manifest and rename it into place atomically."""
        config = read_model_config(staging)
        check_tokenizer(staging)
        weight_files = find_weight_files(staging)
        headers = [read_safetensors_header(p) for p in weight_files]
        architectures = config.get("architectures") or []
        manifest = BackboneManifest(
            format_version=MANIFEST_VERSION,
            name=name,
            architecture=architectures[0] if architectures else "",
            model_type=str(config.get("model_type", "")),
            num_parameters=sum(h.num_parameters for h in headers),
            bytes=sum(h.num_bytes for h in headers),
            dtypes=tuple(sorted({t.dtype for h in headers for t in h.tensors.values()})),
            weights_sha256=hash_files(weight_files, progress),
            weight_files=tuple(p.name for p in weight_files),
            source=source,
            base_model_ids=base_model_ids,
            created_at=time.time(),
        )
        (staging / MANIFEST_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
        for path in staging.iterdir():  # entries are shared read-only with every function process
            path.chmod(0o644)
        staging.chmod(0o755)
        final = self.path(name)
        try:
            os.rename(staging, final)
        except OSError as exc:  # another import of the same name won the race
            raise AlreadyExists(f"backbone {name!r} was imported concurrently; try again") from exc
        return manifest


def read_model_config(directory: Path) -> dict:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise MalformedModel(f"{directory} has no config.json; expected a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedModel(f"{config_path} is not valid JSON: {exc}") from exc
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForCausalLM") for a in architectures):
        raise MalformedModel(
            f"{config_path}: architectures {architectures} name no causal language model (*ForCausalLM)"
        )
    return config


def find_weight_files(directory: Path) -> list[Path]:
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        pickled = pickled_files(directory)
        if pickled:
            raise PickledWeightsRefused(
                f"{directory} has only pickled weights ({', '.join(p.name for p in pickled)}); loading a pickle can "
                "run arbitrary code, so lorafaas accepts safetensors only. Convert them first, e.g. "
                "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)`"
            )
        raise MalformedModel(f"{directory} has no *.safetensors weight files")
    for path in weights:
        read_safetensors_header(path)  # refuses truncated or malformed files before anything is copied
    return weights


def check_tokenizer(directory: Path) -> None:
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise MalformedModel(f"{directory} has no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})")


def hash_files(paths: list[Path], progress: ProgressSink | None = None) -> str:
    """sha256 over the files' bytes in the given order."""
    progress = progress or SilentProgress()
    progress.stage("hashing weights", sum(p.stat().st_size for p in paths))
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while chunk := f.read(HASH_CHUNK_BYTES):
                digest.update(chunk)
                progress.advance(len(chunk))
    return digest.hexdigest()


def _copy_with_progress(src: Path, dst: Path, progress: ProgressSink) -> None:
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(HASH_CHUNK_BYTES):
            fout.write(chunk)
            progress.advance(len(chunk))


def _recorded_ids(source_dir: Path) -> tuple[str, ...]:
    """The names a store entry's manifest recorded, when the source is one (transformers 5 no longer writes
    `_name_or_path` to config.json, so a re-import would otherwise lose the hub id its adapters name)."""
    try:
        manifest = msgspec.json.decode((source_dir / MANIFEST_FILE).read_bytes(), type=BackboneManifest)
    except (OSError, msgspec.DecodeError):
        return ()
    return manifest.base_model_ids
