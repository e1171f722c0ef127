"""Keep-alive under the node's memory budget on a live platform (`up --idle-budget`): three functions' idle
instances, each with a keep-alive of ten minutes, where the budget holds two; one retires at once and answers again
from a cold start. Which one is the pure policy's choice (tests/unit/scheduler/test_idle_budget.py): here every
window is long enough that each function's call within it is near certain, so the measured starts decide."""

from __future__ import annotations

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.agent.artifacts import INSTANCE_OVERHEAD_BYTES
from lorafaas.testing.platform_process import PlatformProcess, wait_for
from lorafaas.testing.tiny_models import save_tiny_adapter


def chat(prompt: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}


def test_idle_instances_beyond_the_budget_retire_lowest_value_per_byte_first(tmp_path, tiny_dense_dir) -> None:
    store = ModelStore(tmp_path / "models")
    store.import_dir("tiny-dense", tiny_dense_dir)
    adapters = {name: save_tiny_adapter(tmp_path / f"a-{name}", tiny_dense_dir, seed=seed,
                                        base_model_name="tiny-dense")
                for seed, name in enumerate(("popular", "rare-a", "rare-b"), start=1)}
    largest = max((a / "adapter_model.safetensors").stat().st_size for a in adapters.values())
    budget = 2 * (INSTANCE_OVERHEAD_BYTES + largest) + 1024  # two idle instances, not three
    with PlatformProcess(tmp_path, extra_args=("--idle-budget", str(budget))) as platform, \
            platform.client() as admin:
        for name, adapter in adapters.items():
            admin.deploy({"name": name, "backbone": "tiny-dense", "keep_alive_s": 600, "max_instances": 1}, adapter)
        for k in range(6):
            admin.invoke("popular", chat(f"hello {k}"))
        admin.invoke("rare-a", chat("once"))
        admin.invoke("rare-b", chat("once"))

        def instances() -> dict[str, int] | None:
            counts = {name: len(admin.describe(name)["instances"]) for name in adapters}
            return counts if sum(counts.values()) <= 2 else None

        counts = wait_for(instances, 30, "the idle instances within the budget of two")
        assert sorted(counts.values()) == [0, 1, 1], counts  # one retired, long before its keep-alive
        retired = next(name for name, count in counts.items() if count == 0)
        assert admin.invoke(retired, chat("again"))["usage"]["completion_tokens"] >= 1
