"""Which PEFT LoRA features lorafaas runs, decided once for deploy and for the runtime.

Each field of PEFT's `LoraConfig` is either run exactly as PEFT runs it (outputs equal PEFT's token for token, checked
by tests/unit/test_adapter_properties.py) or refused with `AdapterUnsupported` (422 `adapter_unsupported`) naming the
field. Nothing is ignored silently: a tensor lorafaas would not use is a refusal too. Three steps, all torch-free:

- `check_config(config)`: the fields' types and values (read_adapter, so `adapter inspect` refuses them too), and
  the config's patterns, compiled once (`adapter_patterns.py`);
- `plan_tensors(config, tensors, patterns)`: which tensor is what (LoRA factors, `lora_B` biases, `modules_to_save`
  copies), each module's rank and scaling, from the safetensors header alone;
- `check_against_model(config, layout, modules)`: which modules PEFT would adapt in this backbone's module tree
  (`target_modules`, `exclude_modules`, `layers_to_transform`, `modules_to_save`), and that the weights are exactly
  those, with fitting shapes.

Deploy runs all three on the backbone built on the meta device; a worker runs the same on its bound model before it
places the adapter, so an adapter that deploys never fails at invocation.

PEFT's patterns (`target_modules` as a string, `exclude_modules`, the keys of `rank_pattern`/`alpha_pattern`,
`layers_pattern`, and `modules_to_save` names, which PEFT splices into regexes) run on RE2, whose matching time is
linear in the input, so no pattern can stall the gateway; one RE2 cannot compile (lookaround, backreferences) is
refused with 422, and so is a config whose patterns exceed the count and compile budget of `adapter_patterns.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lorafaas.errors import AdapterIncompatible, AdapterInvalid
from lorafaas.formats.adapter_patterns import (
    DEFAULT_LAYERS_REGEX,
    AdapterPatterns,
    check_count,
    layers_pattern_regex,
    rank_pattern_regex,
    saved_module_regex,
    unsupported,
)
from lorafaas.formats.weights import TensorInfo

PEFT_PREFIX = "base_model.model."
LORA_PARTS = {".lora_A.weight": "a", ".lora_B.weight": "b", ".lora_B.bias": "bias"}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # cast to float32 on load, as PEFT's load_state_dict does
MAX_FLOAT32 = 3.4028234663852886e38
DEFAULT_LORA_ALPHA = 8  # PEFT's LoraConfig default

# Fields that only matter while training, or metadata: run as PEFT runs them at inference, i.e. without effect.
IGNORED_FIELDS = frozenset({
    "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "lora_dropout", "megatron_core", "qalora_group_size", "runtime_config", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "lorafaas_experts",
    # fan_in_fan_out only transposes the delta when merging into a Conv1D; an unmerged nn.Linear ignores it
    "fan_in_fan_out",
})
# Fields run exactly, checked below.
RUN_FIELDS = frozenset({
    "task_type", "r", "target_modules", "exclude_modules", "lora_alpha", "use_rslora", "bias", "lora_bias",
    "modules_to_save", "init_lora_weights", "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern",
})
# Fields whose feature lorafaas refuses when set (any value other than None/False/empty).
REFUSED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported; use plain LoRA",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "target_parameters": "LoRA on bare parameters (target_parameters) is not supported; MoE experts use lorafaas's "
                         "expert adapters (`lorafaas moe create-adapter`)",
    "layer_replication": "layer replication changes the backbone's layers and is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA is for quantized backbones and is not supported",
    "velora_config": "VeLoRA is not supported",
    "monteclora_config": "MonteCLoRA is not supported",
    "megatron_config": "Megatron parallel layers are not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "KaSA is not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "ensure_weight_tying": "ensure_weight_tying (adapters shared across tied embeddings) is not supported",
}
# init_lora_weights values that change the backbone's weights when PEFT loads the adapter (PiSSA, OLoRA, ...).
SAFE_INITS = (True, False, "gaussian", "orthogonal")


# -- config fields -----------------------------------------------------------------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def check_config(config: dict) -> AdapterPatterns:
    """Refuse fields of the wrong type (AdapterInvalid) and features lorafaas does not run (AdapterUnsupported);
    return the config's patterns, each compiled once (`plan_tensors` and `check_against_model` match with them)."""
    patterns = AdapterPatterns()
    for name, why in REFUSED_FIELDS.items():
        if config.get(name) not in (None, False, [], {}, ""):
            raise unsupported(name, why)
    for name, value in config.items():
        if name not in IGNORED_FIELDS and name not in RUN_FIELDS and name not in REFUSED_FIELDS \
                and value not in (None, False, [], {}, ""):
            raise unsupported(name, "a field lorafaas does not know (it supports PEFT 0.21's LoRA fields)")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise unsupported("task_type", f"{config['task_type']!r}; lorafaas serves causal LMs ('CAUSAL_LM')")
    alpha = config.get("lora_alpha", DEFAULT_LORA_ALPHA)
    if not _is_number(alpha) or not math.isfinite(alpha):
        raise AdapterInvalid(f"adapter_config.json: lora_alpha must be a finite number, got {alpha!r}")
    for name, check, what in (
        ("rank_pattern", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer"),
        ("alpha_pattern", lambda v: _is_number(v) and math.isfinite(v), "a finite number"),
    ):
        keys = config.get(name) or {}
        if not isinstance(keys, dict):
            raise AdapterInvalid(f"adapter_config.json: {name} must be an object, got {keys!r}")
        check_count(name, keys)
        for key, value in keys.items():
            patterns.compile(name, rank_pattern_regex(key), key)
            if not check(value):
                raise AdapterInvalid(f"adapter_config.json: {name}[{key!r}] must be {what}, got {value!r}")
    for name in ("use_rslora", "lora_bias"):
        if not isinstance(config.get(name, False), bool):
            raise AdapterInvalid(f"adapter_config.json: {name} must be true or false, got {config[name]!r}")
    if config.get("bias", "none") not in ("none", "all", "lora_only"):
        raise AdapterInvalid(f"adapter_config.json: bias must be 'none', 'all' or 'lora_only', got {config['bias']!r}")
    init = config.get("init_lora_weights", True)
    if not any(init is v if isinstance(v, bool) else init == v for v in SAFE_INITS):
        raise unsupported("init_lora_weights", f"{init!r} changes the backbone's weights when the adapter is loaded; "
                          "convert the adapter to plain LoRA first (PEFT's path_initial_model_for_weight_conversion)")
    if config.get("lora_bias") and not isinstance(init, bool):
        raise AdapterInvalid(f"adapter_config.json: lora_bias is true, which PEFT allows only with init_lora_weights "
                             f"true or false, got {init!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets.lower() != "all-linear":
        patterns.compile("target_modules", targets)
    excluded = config.get("exclude_modules")
    if excluded is not None and not (isinstance(excluded, str) or _is_str_list(excluded)):
        raise AdapterInvalid(
            f"adapter_config.json: exclude_modules must be a list of names or a regex, got {excluded!r}"
        )
    if isinstance(excluded, str):
        patterns.compile("exclude_modules", excluded)
    saved = config.get("modules_to_save")
    if saved is not None and not _is_str_list(saved):
        raise AdapterInvalid(f"adapter_config.json: modules_to_save must be a list of names, got {saved!r}")
    check_count("modules_to_save", saved or [], "names")
    for name in saved or []:
        patterns.compile("modules_to_save", saved_module_regex(name), name)
    layers = config.get("layers_to_transform")
    if layers is not None and not (isinstance(layers, int) and not isinstance(layers, bool)) and not (
        isinstance(layers, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in layers)
    ):
        raise AdapterInvalid(f"adapter_config.json: layers_to_transform must be an integer or a list of integers, "
                             f"got {layers!r}")
    layers_pattern = config.get("layers_pattern")
    if layers_pattern is not None and not (isinstance(layers_pattern, str) or _is_str_list(layers_pattern)):
        raise AdapterInvalid(f"adapter_config.json: layers_pattern must be a name or a list of names, "
                             f"got {layers_pattern!r}")
    check_count("layers_pattern", [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern or [],
                "names")
    for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern or []:
        patterns.compile("layers_pattern", layers_pattern_regex(pattern), pattern)
    if layers is not None and layers != []:
        patterns.compile("layers_to_transform", DEFAULT_LAYERS_REGEX)
    return patterns


# -- tensors -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraEntry:
    """One adapted Linear: its tensors' names in the file, rank and scaling."""

    a: str
    b: str
    bias: str | None
    rank: int
    scaling: float
    shapes: tuple[int, int]  # (in_features, out_features)


@dataclass(frozen=True)
class AdapterLayout:
    loras: dict[str, LoraEntry]  # module path -> entry
    saved: dict[str, TensorInfo] = field(default_factory=dict)  # "<module>.<parameter>" -> tensor (modules_to_save)
    tensor_names: dict[str, str] = field(default_factory=dict)  # "<module>.<parameter>" -> name in the file
    patterns: AdapterPatterns = field(default_factory=AdapterPatterns, compare=False)  # from check_config


def plan_tensors(config: dict, tensors: dict[str, TensorInfo], patterns: AdapterPatterns) -> AdapterLayout:
    """Classify every tensor of adapter_model.safetensors; refuse any lorafaas would not use. `patterns` is what
    `check_config(config)` returned."""
    parts: dict[str, dict[str, TensorInfo]] = {}
    saved: dict[str, TensorInfo] = {}
    names: dict[str, str] = {}
    for name, info in tensors.items():
        if info.dtype not in FLOAT_DTYPES:
            raise unsupported("dtype", f"tensor {name} is {info.dtype}; LoRA weights must be F16, BF16, F32 or F64")
        key = name.removeprefix(PEFT_PREFIX)
        part = next((p for p in LORA_PARTS if key.endswith(p)), None)
        if part is not None:
            parts.setdefault(key[: -len(part)], {})[LORA_PARTS[part]] = info
        elif ".lora_embedding_" in key:
            raise unsupported("target_modules", f"tensor {name}: LoRA on embedding layers is not supported")
        elif ".base_layer." in key:
            raise unsupported(
                "target_modules", f"tensor {name} is a copy of a backbone weight, which PEFT saves when an adapter "
                "targets an embedding or tied layer; lorafaas never replaces backbone weights (if it is unchanged, "
                "re-save with save_pretrained(..., save_embedding_layers=False))"
            )
        elif ".lora_magnitude_vector" in key:
            raise unsupported("use_dora", f"tensor {name} is a DoRA magnitude; DoRA is not supported")
        elif "trainable_tokens" in key or "token_adapter" in key:
            raise unsupported("trainable_token_indices", f"tensor {name}: trainable tokens are not supported")
        elif ".lora_" in key:
            raise unsupported("weights", f"tensor {name} is not a LoRA factor lorafaas knows (lora_A, lora_B)")
        elif config.get("modules_to_save"):
            saved[key], names[key] = info, name
        else:
            raise unsupported(
                "modules_to_save" if config.get("bias", "none") == "none" else "bias",
                f"tensor {name} is a backbone parameter, but modules_to_save is empty"
                + ("" if config.get("bias", "none") == "none" else "; trained backbone biases are not supported"),
            )
    alpha_default = config.get("lora_alpha", DEFAULT_LORA_ALPHA)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    loras: dict[str, LoraEntry] = {}
    for module, sides in sorted(parts.items()):
        if "a" not in sides or "b" not in sides:
            missing = "lora_B" if "a" in sides else "lora_A"
            raise AdapterInvalid(f"adapter_model.safetensors: module {module} has no {missing} weight")
        a, b, bias = sides["a"], sides["b"], sides.get("bias")
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise AdapterInvalid(f"adapter_model.safetensors: module {module} has lora_A {list(a.shape)} and lora_B "
                                 f"{list(b.shape)}; expected [r, in_features] and [out_features, r]")
        rank = a.shape[0]
        if rank == 0:
            raise AdapterInvalid(f"adapter_model.safetensors: module {module} has rank 0 (lora_A {list(a.shape)})")
        rank_key = patterns.pattern_key("rank_pattern", rank_pattern, module)
        expected = rank_pattern[rank_key] if rank_key is not None else config["r"]
        if rank != expected:
            source = f"rank_pattern[{rank_key!r}]" if rank_key is not None else "r"
            raise AdapterInvalid(f"rank mismatch: adapter_config.json says {source}={expected} but the weights have "
                                 f"rank {rank} ({module}.lora_A)")
        if bias is not None and not config.get("lora_bias"):
            raise AdapterInvalid(f"lora_bias: adapter_config.json says false, but {module} has a lora_B.bias")
        if bias is None and config.get("lora_bias"):
            raise AdapterInvalid(f"lora_bias: adapter_config.json says true, but {module} has no lora_B.bias")
        if bias is not None and bias.shape != (b.shape[0],):
            raise AdapterInvalid(f"adapter_model.safetensors: {module}.lora_B.bias is {list(bias.shape)}; expected "
                                 f"[{b.shape[0]}]")
        alpha_key = patterns.pattern_key("alpha_pattern", alpha_pattern, module)
        alpha = alpha_pattern[alpha_key] if alpha_key is not None else alpha_default
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        if not abs(scaling) <= MAX_FLOAT32:
            raise AdapterInvalid(f"lora_alpha: {alpha!r} gives {module} a scaling of {scaling!r}, which float32 "
                                 "cannot hold")
        loras[module] = LoraEntry(a=a.name, b=b.name, bias=bias.name if bias else None, rank=rank, scaling=scaling,
                                   shapes=(a.shape[1], b.shape[0]))
    if not loras and not saved:
        raise AdapterInvalid("adapter_model.safetensors holds no LoRA weights (no '*.lora_A.weight' tensors)")
    return AdapterLayout(loras=loras, saved=saved, tensor_names=names, patterns=patterns)


# -- the backbone's modules --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModuleSlot:
    """What PEFT sees of one backbone module: its class, Linear sizes, own parameters, whether it has children."""

    kind: str  # class name; "Linear" for torch.nn.Linear
    in_features: int = 0
    out_features: int = 0
    parameters: dict[str, tuple[int, ...]] = field(default_factory=dict)
    is_leaf: bool = True


@dataclass(frozen=True)
class ModuleTable:
    modules: dict[str, ModuleSlot]  # every named module but the root, as `named_modules(remove_duplicate=False)`
    output_layer: str | None  # the output embedding's name ("lm_head"), which all-linear leaves out


def _peft_targets(config: dict, table: ModuleTable, key: str, patterns: AdapterPatterns) -> bool:
    """PEFT's check_target_module_exists (peft/tuners/tuners_utils.py), on RE2."""
    excluded = config.get("exclude_modules")
    if isinstance(excluded, str) and patterns.fullmatch("exclude_modules", excluded, key):
        return False
    if isinstance(excluded, list) and (key in excluded or any(key.endswith(f".{e}") for e in excluded)):
        return False
    if any(patterns.match("modules_to_save", saved_module_regex(m), key) for m in config.get("modules_to_save") or []):
        return False
    targets = config.get("target_modules") or []
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = [n for n, s in table.modules.items() if s.kind == "Linear" and n != table.output_layer]
    if isinstance(targets, str):
        return patterns.fullmatch("target_modules", targets, key)
    if key in targets:
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    layers_pattern = config.get("layers_pattern")
    found = None
    if not layers_pattern:
        found = patterns.layer_index(DEFAULT_LAYERS_REGEX, key)
    else:
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            found = patterns.layer_index(layers_pattern_regex(pattern), key)
            if found is not None:
                break
    if found is None:
        return False
    return found == layers if isinstance(layers, int) else found in layers


def saved_modules(config: dict, table: ModuleTable) -> list[str]:
    """The modules PEFT wraps for modules_to_save: every name that ends with one (PEFT's `_set_trainable`)."""
    names = config.get("modules_to_save") or []
    return [key for key in table.modules if any(key.endswith(n) for n in names)]


def check_against_model(config: dict, layout: AdapterLayout, table: ModuleTable, backbone: str = "the backbone"
                        ) -> None:
    """Refuse unless the weights are exactly the modules PEFT would adapt in `table`, with fitting shapes."""
    targeted = [key for key in table.modules if _peft_targets(config, table, key, layout.patterns)]
    targets = config.get("target_modules") or []
    if not targeted and (targets or not layout.saved):
        raise AdapterIncompatible(f"target_modules {targets!r} matches no layer of backbone {backbone!r}")
    if isinstance(targets, list):
        leaf_names = {path.rsplit(".", 1)[-1] for path in table.modules}
        unknown = [t for t in targets if t not in leaf_names and t not in table.modules
                   and not any(p.endswith("." + t) for p in table.modules)]
        if unknown:
            linear = sorted({p.rsplit(".", 1)[-1] for p, s in table.modules.items() if s.kind == "Linear"})
            raise AdapterIncompatible(
                f"unknown target module(s) {', '.join(map(repr, unknown))}: no such layer in backbone {backbone!r} "
                f"(its linear layers are {', '.join(linear)})"
            )
    for key in targeted:
        if table.modules[key].kind != "Linear":
            raise unsupported("target_modules", f"selects {key}, a {table.modules[key].kind}; lorafaas runs LoRA on "
                              "Linear layers only")
    missing = sorted(set(targeted) - set(layout.loras))
    if missing:
        raise AdapterInvalid(f"target_modules selects {missing[0]} ({len(missing)} module(s) in all), but "
                             "adapter_model.safetensors has no lora_A/lora_B for it")
    extra = sorted(set(layout.loras) - set(targeted))
    if extra:
        raise AdapterIncompatible(
            f"adapter layer {extra[0]} is not selected by target_modules in backbone {backbone!r}"
            if extra[0] not in table.modules else
            f"target_modules does not select {extra[0]}, yet adapter_model.safetensors has LoRA weights for it "
            "(PEFT would ignore them)"
        )
    _check_shapes(layout, table, backbone)
    _check_saved(config, layout, table)


def _check_shapes(layout: AdapterLayout, table: ModuleTable, backbone: str) -> None:
    for path, entry in layout.loras.items():
        slot = table.modules[path]
        if entry.shapes != (slot.in_features, slot.out_features):
            raise AdapterIncompatible(
                f"shape mismatch at {path}: the adapter maps {entry.shapes[0]} -> {entry.shapes[1]} features, but "
                f"backbone {backbone!r} has {slot.in_features} -> {slot.out_features} there"
            )


def _check_saved(config: dict, layout: AdapterLayout, table: ModuleTable) -> None:
    expected: dict[str, tuple[int, ...]] = {}
    for module in saved_modules(config, table):
        slot = table.modules[module]
        if not slot.is_leaf or not slot.parameters:
            raise unsupported("modules_to_save", f"selects {module}, a {slot.kind} with submodules or no parameters; "
                              "lorafaas saves whole leaf modules only")
        expected.update({f"{module}.{p}": shape for p, shape in slot.parameters.items()})
    for key, info in layout.saved.items():
        if key not in expected:
            raise unsupported("modules_to_save", f"tensor {layout.tensor_names[key]} belongs to no module that "
                              "modules_to_save selects")
        if info.shape != expected[key]:
            raise AdapterIncompatible(f"modules_to_save: {key} is {list(info.shape)} in the adapter, "
                                      f"{list(expected[key])} in the backbone")
    missing = sorted(set(expected) - set(layout.saved))
    if missing:
        raise AdapterInvalid(f"modules_to_save selects {missing[0].rsplit('.', 1)[0]}, but adapter_model.safetensors "
                             f"has no {missing[0]}")
