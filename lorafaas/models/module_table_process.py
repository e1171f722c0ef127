"""A backbone's module table (what PEFT's matching sees of it) built in a child process, for the gateway.

Building it needs torch and transformers (the model on the meta device): about 250 MB of libraries and heap that the
gateway's process would otherwise keep for good only to check uploads. The child builds it once per backbone and
prints it as JSON; the caller caches it in memory by the backbone's directory and config file (a re-imported backbone
of the same name has a new config file, so a new table) and on disk by the config's content and the transformers
version (`$XDG_CACHE_HOME/lorafaas/module-tables`, default `~/.cache`), so a platform's restart, or another home on
the same backbone, does not start the child again (it takes seconds: torch and transformers are imported).

    python -m lorafaas.models.module_table_process MODEL_DIR      prints the table as JSON, exit 0
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

from lorafaas.errors import MalformedModel
from lorafaas.formats.adapter_rules import ModuleTable


def module_table_of(model_dir: Path) -> ModuleTable:
    """The module table of the backbone in `model_dir`, built in a child process once per config file."""
    model_dir = Path(model_dir).resolve()
    try:
        stat = (model_dir / "config.json").stat()
    except OSError as exc:
        raise MalformedModel(f"{model_dir}: no readable config.json ({exc.strerror})") from exc
    return _built(str(model_dir), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _built(model_dir: str, _mtime_ns: int, _size: int) -> ModuleTable:
    cached = _cache_path(Path(model_dir) / "config.json")
    if cached is not None and cached.is_file():
        try:
            return msgspec.json.decode(cached.read_bytes(), type=ModuleTable)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            pass  # a damaged entry: built again and replaced
    result = subprocess.run([sys.executable, "-m", __name__, model_dir], capture_output=True, text=False, check=False)
    if result.returncode != 0:
        reason = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise MalformedModel(f"{model_dir}: the backbone's module tree cannot be built: {reason[0]}")
    table = msgspec.json.decode(result.stdout, type=ModuleTable)
    if cached is not None:
        _write_atomically(cached, result.stdout)
    return table


def _cache_path(config_file: Path) -> Path | None:
    """Where the table of a backbone with this config is kept: the module tree depends only on the config and the
    transformers version. None: no cache (the config unreadable, or transformers not installed)."""
    try:
        key = hashlib.sha256(config_file.read_bytes() + importlib.metadata.version("transformers").encode())
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "lorafaas" / "module-tables" / f"{key.hexdigest()}.json"


def _write_atomically(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, path)
    except OSError:
        pass  # a cache that cannot be written only costs the next start the child again


def _main(model_dir: str) -> None:
    from lorafaas.models.binding import build_empty_model
    from lorafaas.models.lora import module_table

    sys.stdout.buffer.write(msgspec.json.encode(module_table(build_empty_model(Path(model_dir)))))


if __name__ == "__main__":
    _main(sys.argv[1])
