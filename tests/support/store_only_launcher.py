"""A backend that runs nothing: what a `NodeAgent` reads of one (no daemon, no library pool) and its model store, for
tests that build an agent's views, plans and metrics without starting a process."""

from __future__ import annotations

from lorafaas.formats.model_store import ModelStore


class StoreOnlyLauncher:
    zygote_pid = None
    lora_servers = None
    log_dir = None

    def __init__(self, store: ModelStore) -> None:
        self.store = store

    def running_backbones(self, device: str | None = None) -> list[str]:
        return []

    def forget_failures(self, function: str) -> None:
        pass

    def close(self) -> None:
        pass
