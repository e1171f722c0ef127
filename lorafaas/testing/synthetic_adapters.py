"""Random LoRA adapters with a backbone's exact shapes, written straight from its safetensors header (no model load).

Benchmarks need many distinct adapters for the real backbone; tests need adapters that fit or deliberately do not.
B is non-zero (unlike a freshly initialised PEFT adapter), so every adapter changes the backbone's output.
"""

from __future__ import annotations

import json
from pathlib import Path

from lorafaas.formats.adapter_files import CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.adapter_validation import backbone_linear_layers
from lorafaas.platform.adapter_limits import DEFAULT_MAX_BACKBONE_FRACTION
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.testing.fleet_workload import FleetAdapter


def write_random_adapter(
    out_dir: Path,
    store: ModelStore,
    backbone: str,
    *,
    rank: int = 8,
    alpha: int = 16,
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    seed: int = 0,
    scale: float = 0.02,
) -> Path:
    import torch
    from safetensors.torch import save_file

    layers = backbone_linear_layers(store, store.get(backbone))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    present: set[str] = set()
    for path, (out_features, in_features) in sorted(layers.items()):
        module = path.rsplit(".", 1)[-1]
        if module not in target_modules:
            continue
        present.add(module)
        tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * scale
        tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * scale
    if not tensors:
        raise ValueError(f"no layer of {backbone} matches target modules {target_modules}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / WEIGHTS_FILE)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": backbone, "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": [m for m in target_modules if m in present],
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def write_fleet(out_dir: Path, store: ModelStore, backbone: str, plan: list[FleetAdapter],
                progress: ProgressSink | None = None) -> list[Path]:
    """Write each planned adapter under `out_dir` (a directory per name), keeping one already written with the same
    plan (a marker file holds its rank, modules and seed), so a second run over the same fleet writes nothing."""
    progress = progress or SilentProgress()
    progress.stage(f"writing {len(plan)} adapters of {backbone} in {out_dir}", total=len(plan))
    manifest = store.get(backbone)
    layers = backbone_linear_layers(store, manifest)
    paths = []
    for adapter in plan:
        path = Path(out_dir) / adapter.name
        marker = path / ".fleet-plan"
        # what a deploy refuses (adapter_limits): a rank beyond a layer's min(in, out), or an adapter over a
        # fraction of its backbone; a small backbone's adapters get the largest rank it allows
        adapted = [shape for layer, shape in layers.items() if layer.rsplit(".", 1)[-1] in adapter.target_modules]
        per_rank = sum(sum(shape) for shape in adapted)
        fits = int(manifest.num_parameters * DEFAULT_MAX_BACKBONE_FRACTION) // max(per_rank, 1)
        rank = max(1, min([adapter.rank, fits, *(min(shape) for shape in adapted)]))
        stamp = json.dumps([backbone, rank, list(adapter.target_modules), adapter.seed])
        if not (marker.is_file() and marker.read_text() == stamp):
            # target modules the backbone lacks (gate_proj, ... on a backbone without them) are left out
            write_random_adapter(path, store, backbone, rank=rank, alpha=2 * rank,
                                 target_modules=adapter.target_modules, seed=adapter.seed)
            marker.write_text(stamp)
        paths.append(path)
        progress.advance()
    return paths


def main(argv: list[str] | None = None) -> int:
    """Write `--count` random adapters of a backbone in a lorafaas home, one directory each (`PREFIX-1`, ...): the
    extra adapters of a benchmark over more functions than the demo's three (docs/performance.md)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lorafaas.testing.synthetic_adapters", description=main.__doc__)
    parser.add_argument("--home", type=Path, required=True, help="the lorafaas home holding the backbone")
    parser.add_argument("--backbone", default="smollm2-135m")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default="synthetic")
    args = parser.parse_args(argv)
    if not 1 <= args.count <= 1000:
        parser.error(f"--count is {args.count}; must be in [1, 1000]")
    store = ModelStore(args.home / "models")
    for k in range(1, args.count + 1):
        print(write_random_adapter(args.out / f"{args.prefix}-{k}", store, args.backbone, seed=k))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
