"""function.yaml: a function's deploy settings, its keys spelled as `lorafaas deploy`'s flags or as the API's fields.

`keep-alive: 60` (the flag), `keep_alive: 60` and `keep_alive_s: 60` (the field of `POST /v1/functions`) all set
`keep_alive_s`; a key lorafaas does not know, or two spellings of one setting, are refused naming them.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from lorafaas.errors import InvalidInput

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
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput(f"cannot read {path}: {exc}") from exc
    if not isinstance(document, dict):
        raise InvalidInput(f"{path} must be a YAML mapping of function settings (see examples/function.yaml)")
    unknown = sorted(str(key) for key in document if key not in FIELD_OF)
    if unknown:
        known = ", ".join(spellings[0] for spellings in SPELLINGS.values())
        raise InvalidInput(f"{path}: unknown key(s) {', '.join(unknown)}; known: {known} (each also spelled with "
                           "_ for -, or as the API field, e.g. keep_alive_s)")
    spec: dict = {}
    given_as: dict[str, str] = {}
    for key, value in document.items():
        field = FIELD_OF[key]
        if field in spec:
            raise InvalidInput(f"{path}: {given_as[field]} and {key} both set {field}; keep one")
        spec[field], given_as[field] = value, key
    if spec.get("adapter") is not None:
        spec["adapter"] = str((path.parent / str(spec["adapter"])).resolve())
    return spec
