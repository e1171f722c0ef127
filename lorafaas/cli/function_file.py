"""function.yaml: a function's deploy settings (a list of them: a fleet), its keys spelled as `lorafaas deploy`'s
flags or as the API's fields.

`keep-alive: 60` (the flag), `keep_alive: 60` and `keep_alive_s: 60` (the field of `POST /v1/functions`) all set
`keep_alive_s`; a key lorafaas does not know, or two spellings of one setting, are refused naming them.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from lorafaas.errors import InvalidInput
from lorafaas.formats.adapter_files import CONFIG_FILE

# API field -> its spellings in function.yaml: the deploy flag (with - or _) first, then the field's own name.
SPELLINGS: dict[str, tuple[str, ...]] = {
    "name": ("name",),
    "adapter": ("adapter",),
    "backbone": ("backbone",),
    "slo_ttft_ms": ("slo-ttft-ms", "slo_ttft_ms"),
    "keep_alive_s": ("keep-alive", "keep_alive", "keep_alive_s"),
    "min_instances": ("min", "min_instances"),
    "max_instances": ("max", "max_instances"),
    "max_tokens_limit": ("max-tokens-limit", "max_tokens_limit"),
    "max_request_s": ("max-request-s", "max_request_s"),
    "lora_mode": ("lora-mode", "lora_mode"),
    "shared_base": ("shared-base", "shared_base"),
    "tenant": ("tenant",),
}
FIELD_OF = {spelling: field for field, spellings in SPELLINGS.items() for spelling in spellings}


def read_function_file(path: Path) -> dict:
    """The file's settings keyed by API field; `adapter` made absolute (it is relative to the file)."""
    document = _load(path)
    if not isinstance(document, dict):
        raise InvalidInput(f"{path} must be a YAML mapping of function settings (see examples/function.yaml)")
    return _spec(document, path, str(path))


def is_fleet(path: Path) -> bool:
    """Whether `deploy -f PATH` deploys many functions: a directory of adapters, or a file holding a list."""
    return path.is_dir() or isinstance(_load(path), list)


def read_fleet_file(path: Path) -> list[dict]:
    """A YAML or JSON list of function settings (each as in function.yaml, with its `adapter`)."""
    document = _load(path)
    if not isinstance(document, list) or not document:
        raise InvalidInput(f"{path} must be a non-empty YAML or JSON list of functions (see examples/fleet.yaml)")
    specs = []
    for index, entry in enumerate(document):
        if not isinstance(entry, dict):
            raise InvalidInput(f"{path}: entry {index} is not a mapping of function settings")
        specs.append(_spec(entry, path, f"{path}: entry {index}"))
    return specs


def read_adapter_dirs(root: Path) -> list[dict]:
    """A directory of adapters: one function per subdirectory holding an adapter_config.json, named after it, on
    the backbone its config names (`base_model_name_or_path`), unless `--backbone` says otherwise."""
    specs = []
    for directory in sorted(p for p in root.iterdir() if (p / CONFIG_FILE).is_file()):
        try:
            config = json.loads((directory / CONFIG_FILE).read_text())
        except (OSError, ValueError):
            config = {}  # the platform refuses the adapter itself, naming its entry
        base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
        specs.append({"name": directory.name, "adapter": str(directory.resolve()),
                      **({"backbone": base} if isinstance(base, str) and base else {})})
    if not specs:
        raise InvalidInput(f"{root} holds no adapter directory (a subdirectory with {CONFIG_FILE})")
    return specs


def _load(path: Path) -> object:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput(f"cannot read {path}: {exc}") from exc


def _spec(document: dict, path: Path, where: str) -> dict:
    unknown = sorted(str(key) for key in document if key not in FIELD_OF)
    if unknown:
        known = ", ".join(spellings[0] for spellings in SPELLINGS.values())
        raise InvalidInput(f"{where}: unknown key(s) {', '.join(unknown)}; known: {known} (each also spelled with "
                           "_ for -, or as the API field, e.g. keep_alive_s)")
    spec: dict = {}
    given_as: dict[str, str] = {}
    for key, value in document.items():
        field = FIELD_OF[key]
        if field in spec:
            raise InvalidInput(f"{where}: {given_as[field]} and {key} both set {field}; keep one")
        spec[field], given_as[field] = value, key
    if spec.get("adapter") is not None:
        spec["adapter"] = str((path.parent / str(spec["adapter"])).resolve())
    return spec
