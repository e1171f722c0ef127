"""The client's side of a batch deploy: batches cut by count and by bytes, refused entries named by their place in
the whole fleet, each entry sent once and in order (lorafaas/platform/batch_client.py)."""

from pathlib import Path

import pytest

from lorafaas.errors import AdapterInvalid, InvalidInput
from lorafaas.platform.batch_client import deploy_in_batches
from lorafaas.progress import ProgressSink


class RecordingClient:
    """An ApiClient's two calls a batch deploy makes: the archive is the adapter's name, repeated to its size."""

    def __init__(self, sizes: dict[str, int], refuse: set[str] = frozenset()) -> None:
        self.sizes, self.refuse = sizes, refuse
        self.requests: list[list[str]] = []

    def pack(self, adapter_dir: Path) -> bytes:
        if adapter_dir.name not in self.sizes:
            raise AdapterInvalid(f"{adapter_dir} has no adapter_model.safetensors")
        return b"x" * self.sizes[adapter_dir.name]

    def deploy_many(self, specs: list[dict], archives: list[bytes]) -> dict:
        assert [len(a) for a in archives] == [self.sizes[s["name"]] for s in specs]
        self.requests.append([s["name"] for s in specs])
        refused = [{"index": i, "name": s["name"], "field": "name", "code": "already_exists", "message": "taken"}
                   for i, s in enumerate(specs) if s["name"] in self.refuse]
        return {"deployed": [s for s in specs if s["name"] not in self.refuse], "refused": refused}


class Counted(ProgressSink):
    def __init__(self) -> None:
        self.done = 0.0

    def stage(self, description: str, total: float | None = None) -> None:
        pass

    def advance(self, amount: float = 1) -> None:
        self.done += amount


def specs(names: list[str]) -> list[dict]:
    return [{"name": n, "adapter": Path("/fleet") / n, "backbone": "b"} for n in names]


def test_batches_end_at_the_count_or_before_the_byte_bound() -> None:
    names = [f"f{i}" for i in range(7)]
    client = RecordingClient({"f0": 10, "f1": 10, "f2": 10, "f3": 25, "f4": 10, "f5": 40, "f6": 10})
    progress = Counted()
    outcome = deploy_in_batches(client, specs(names), 3, progress, max_batch_bytes=30)  # type: ignore[arg-type]
    # f3 starts a batch (the first is full at 3), f4 would take it past 30 bytes; f5 alone is past it and goes alone
    assert client.requests == [["f0", "f1", "f2"], ["f3"], ["f4"], ["f5"], ["f6"]]
    assert [d["name"] for d in outcome.deployed] == names and outcome.refused == []
    assert progress.done == 7
    assert "adapter" not in outcome.deployed[0], "the local adapter path is not sent as a spec field"


def test_refused_entries_are_named_by_their_place_in_the_whole_fleet() -> None:
    names = [f"f{i}" for i in range(6)]
    client = RecordingClient({n: 5 for n in names if n != "f1"}, refuse={"f4"})
    outcome = deploy_in_batches(client, specs(names), 2, Counted())  # type: ignore[arg-type]
    assert [(r["index"], r["name"], r["field"]) for r in outcome.refused] == [(1, "f1", "adapter"), (4, "f4", "name")]
    assert [d["name"] for d in outcome.deployed] == ["f0", "f2", "f3", "f5"]
    assert [name for request in client.requests for name in request] == ["f0", "f2", "f3", "f4", "f5"]


def test_a_batch_size_out_of_bounds_is_refused_before_anything_is_sent() -> None:
    client = RecordingClient({"f0": 1})
    with pytest.raises(InvalidInput, match="batch-size"):
        deploy_in_batches(client, specs(["f0"]), 0, Counted())  # type: ignore[arg-type]
    assert client.requests == []
