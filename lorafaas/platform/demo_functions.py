"""`lorafaas up --demo`: the default backbone imported and the demo adapters deployed as functions, if absent."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from lorafaas.errors import FunctionNotFound
from lorafaas.platform.adapter_upload import pack_adapter
from lorafaas.platform.builtin_backbones import DEFAULT_BACKBONE, import_builtin
from lorafaas.platform.state.records import ApiKeyRecord

log = logging.getLogger(__name__)
# examples/ sits beside the package in a clone (the README installs with `pip install -e .`).
DEMO_ADAPTERS_DIR = Path(__file__).resolve().parents[2] / "examples" / "adapters"
DEMO_KEEP_ALIVE_S = 300.0


def demo_adapter_dirs(root: Path = DEMO_ADAPTERS_DIR) -> list[Path]:
    """The adapter directories under `root`, by name."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "adapter_config.json").is_file())


async def deploy_demo_functions(platform) -> list[str]:
    """Import smollm2-135m if absent and deploy each demo adapter as a function of the same name (admin tenant)."""
    _, created = await asyncio.to_thread(import_builtin, platform.models, DEFAULT_BACKBONE)
    if created:
        log.info("imported %s into the model store", DEFAULT_BACKBONE)
    admin = ApiKeyRecord(key_id="demo", tenant="admin", key_hash="", is_admin=True, created_at=time.time())
    names = []
    for adapter_dir in demo_adapter_dirs():
        name = adapter_dir.name
        names.append(name)
        try:
            await asyncio.to_thread(platform.store.get_function, name)
            continue
        except FunctionNotFound:
            pass
        fields = {"name": name, "backbone": DEFAULT_BACKBONE, "keep_alive_s": DEMO_KEEP_ALIVE_S}
        await platform.service.deploy(admin, fields, pack_adapter(adapter_dir))
        log.info("deployed demo function %s", name)
    return names
