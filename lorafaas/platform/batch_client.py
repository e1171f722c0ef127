"""The client's side of a batch deploy (`lorafaas deploy -f FLEET`, `lorafaas bench fleet`): many functions sent in
batches, one `POST /v1/functions:batch` each.

A batch ends at `batch_size` entries or before its archives pass `max_batch_bytes` (the gateway refuses an upload
body past 2 GiB: a hundred rank-64 all-linear adapters would be 7 GB). The next batch's adapters are packed while
the request before it is in flight, so the packing (a tenth of a deploy) is off the path.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from lorafaas.errors import InvalidInput, LorafaasError
from lorafaas.platform.api_client import ApiClient
from lorafaas.platform.batches import MAX_BATCH_FUNCTIONS
from lorafaas.progress import ProgressSink

MAX_BATCH_BYTES = 1024**3  # half the gateway's upload body limit (gateway/limits.py MAX_UPLOAD_BODY_BYTES)

T = TypeVar("T")


@dataclass
class BatchOutcome:
    """What a whole fleet's deploy did; a refused entry's `index` is its place in the whole list of specs."""

    deployed: list[dict] = field(default_factory=list)
    refused: list[dict] = field(default_factory=list)


@dataclass
class _PackedBatch:
    indices: list[int] = field(default_factory=list)  # places in the whole list of the entries sent
    specs: list[dict] = field(default_factory=list)
    archives: list[bytes] = field(default_factory=list)
    refused: list[dict] = field(default_factory=list)  # entries whose adapter could not be read here
    entries: int = 0  # entries this batch covers (sent or refused), for progress

    @property
    def num_bytes(self) -> int:
        return sum(len(a) for a in self.archives)


def deploy_in_batches(client: ApiClient, specs: list[dict], batch_size: int, progress: ProgressSink,
                      max_batch_bytes: int = MAX_BATCH_BYTES) -> BatchOutcome:
    """Deploy `specs` (each with its `adapter` directory and the spec's fields); progress per entry."""
    if not 1 <= batch_size <= MAX_BATCH_FUNCTIONS:
        raise InvalidInput(f"--batch-size is {batch_size}; it must be 1 to {MAX_BATCH_FUNCTIONS}",
                           param="batch_size")
    outcome = BatchOutcome()
    for batch in _one_ahead(_packed_batches(client, specs, batch_size, max_batch_bytes)):
        outcome.refused += batch.refused
        if batch.specs:
            result = client.deploy_many(batch.specs, batch.archives)
            outcome.deployed += result["deployed"]
            outcome.refused += [entry | {"index": batch.indices[entry["index"]]} for entry in result["refused"]]
        progress.advance(batch.entries)
    outcome.refused.sort(key=lambda entry: entry["index"])
    return outcome


def _packed_batches(client: ApiClient, specs: list[dict], batch_size: int, max_batch_bytes: int
                    ) -> Iterator[_PackedBatch]:
    batch = _PackedBatch()
    for index, spec in enumerate(specs):
        try:
            if spec.get("adapter") is None:
                raise InvalidInput("the entry has no `adapter:` directory")
            archive = client.pack(Path(spec["adapter"]))
        except LorafaasError as exc:  # this entry alone: its adapter cannot be read here
            batch.refused.append({"index": index, "name": str(spec.get("name", "")), "field": "adapter",
                                  "code": exc.code, "message": exc.message})
            batch.entries += 1
            continue
        if batch.specs and (len(batch.specs) >= batch_size or batch.num_bytes + len(archive) > max_batch_bytes):
            yield batch
            batch = _PackedBatch()
        batch.indices.append(index)
        batch.specs.append({k: v for k, v in spec.items() if k != "adapter"})
        batch.archives.append(archive)
        batch.entries += 1
    if batch.entries:
        yield batch


def _one_ahead(items: Iterator[T]) -> Iterator[T]:
    """`items`, the next one made in a thread while the caller uses this one."""
    with ThreadPoolExecutor(1, thread_name_prefix="lorafaas-pack") as pool:
        upcoming = pool.submit(next, items, None)
        while (item := upcoming.result()) is not None:
            upcoming = pool.submit(next, items, None)
            yield item
