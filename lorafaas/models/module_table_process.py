"""A backbone's module table (what PEFT's matching sees of it) built in a child process, for the gateway.

Building it needs torch and transformers (the model on the meta device): about 250 MB of libraries and heap that the
gateway's process would otherwise keep for good only to check uploads. The child builds it once per backbone and
prints it as JSON; the caller caches it by the backbone's directory and config file (a re-imported backbone of the
same name has a new config file, so a new table).

    python -m lorafaas.models.module_table_process MODEL_DIR      prints the table as JSON, exit 0
"""

from __future__ import annotations

import functools
import subprocess
import sys
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
    result = subprocess.run([sys.executable, "-m", __name__, model_dir], capture_output=True, text=False, check=False)
    if result.returncode != 0:
        reason = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise MalformedModel(f"{model_dir}: the backbone's module tree cannot be built: {reason[0]}")
    return msgspec.json.decode(result.stdout, type=ModuleTable)


def _main(model_dir: str) -> None:
    from lorafaas.models.binding import build_empty_model
    from lorafaas.models.lora import module_table

    sys.stdout.buffer.write(msgspec.json.encode(module_table(build_empty_model(Path(model_dir)))))


if __name__ == "__main__":
    _main(sys.argv[1])
