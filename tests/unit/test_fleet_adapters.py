"""The fleet benchmark's adapters (synthetic_adapters.fleet_plan / write_fleet): deterministic from seeds, ranks and
target modules mixed as real fleets are, each valid for the backbone."""

from pathlib import Path

from lorafaas.models.adapter_validation import backbone_linear_layers, validate_adapter
from lorafaas.platform.adapter_limits import AdapterLimits, check_adapter_size
from lorafaas.testing.fleet_workload import FLEET_RANKS, FLEET_TARGETS, fleet_plan
from lorafaas.testing.synthetic_adapters import write_fleet


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_fleet_is_the_same_for_the_same_seed_and_mixes_ranks_and_modules(tmp_path, tiny_store) -> None:
    plan = fleet_plan(200, seed=5)
    assert plan == fleet_plan(200, seed=5) and plan != fleet_plan(200, seed=6)
    assert len({a.name for a in plan}) == 200 and len({a.seed for a in plan}) == 200
    assert {a.rank for a in plan} == set(FLEET_RANKS) and {a.target_modules for a in plan} == set(FLEET_TARGETS)
    # the weights hold (5 standard deviations of a share of 200)
    assert abs(sum(a.rank == 8 for a in plan) / 200 - 0.35) < 5 * (0.35 * 0.65 / 200) ** 0.5
    plan = plan[:30]
    first = write_fleet(tmp_path / "a", tiny_store, "tiny-dense", plan)
    write_fleet(tmp_path / "b", tiny_store, "tiny-dense", plan)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")  # byte for byte
    assert len({(p / "adapter_model.safetensors").read_bytes() for p in first}) == 30  # all distinct


def test_every_fleet_adapter_is_valid_for_the_backbone_its_rank_capped_by_the_layers(tmp_path, tiny_store) -> None:
    plan = fleet_plan(15, seed=1)
    manifest = tiny_store.get("tiny-dense")
    layers = backbone_linear_layers(tiny_store, manifest)
    ranks = set()
    for adapter, path in zip(plan, write_fleet(tmp_path, tiny_store, "tiny-dense", plan), strict=True):
        info = validate_adapter(path, tiny_store, "tiny-dense")
        check_adapter_size(path, "tiny-dense", manifest.num_parameters, AdapterLimits())  # what a deploy checks
        smallest = min(min(shape) for layer, shape in layers.items()
                       if layer.rsplit(".", 1)[-1] in adapter.target_modules)
        assert 1 <= info.rank <= min(adapter.rank, smallest)
        ranks.add(info.rank)
        modules = {module.path.rsplit(".", 1)[-1] for module in info.modules}
        # every module planned is there (the tiny backbone has attention and MLP layers, as SmolLM2)
        assert modules == set(adapter.target_modules) == set(info.config["target_modules"])
    assert len(ranks) >= 3  # still mixed on the tiny backbone


def test_a_second_write_of_the_same_fleet_writes_nothing_and_a_changed_plan_rewrites(tmp_path, tiny_store) -> None:
    plan = fleet_plan(3, seed=0)
    [path, *_] = write_fleet(tmp_path, tiny_store, "tiny-dense", plan)
    weights = path / "adapter_model.safetensors"
    written = weights.stat().st_mtime_ns
    write_fleet(tmp_path, tiny_store, "tiny-dense", plan)
    assert weights.stat().st_mtime_ns == written
    write_fleet(tmp_path, tiny_store, "tiny-dense", fleet_plan(3, seed=9, prefix="fleet"))
    assert weights.stat().st_mtime_ns != written

