"""How much adapter a deploy may store: a rank no larger than the layer it adapts, an adapter smaller than its
backbone, and a storage quota per tenant.

A LoRA pair of rank r on a layer with in x out features holds r * (in + out) numbers; beyond r = min(in, out) it
can express nothing a smaller rank could not, so a larger rank only costs memory (a rank-4096 adapter of zeros is a
184 KB archive that unpacks to 188 MB). The checks read the safetensors header only, before anything is stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorafaas.errors import AdapterInvalid, MalformedModel, QuotaExceeded
from lorafaas.formats.adapter_files import PEFT_PREFIX, WEIGHTS_FILE
from lorafaas.formats.weights import read_safetensors_header

DEFAULT_TENANT_ADAPTER_BYTES = 10 * 1024**3
DEFAULT_MAX_BACKBONE_FRACTION = 0.5
LORA_A_SUFFIX = ".lora_A.weight"


@dataclass(frozen=True)
class AdapterLimits:
    # The bytes of adapters a tenant's functions may hold in the adapter store together (an adapter shared by
    # several of its functions counts once).
    max_tenant_bytes: int = DEFAULT_TENANT_ADAPTER_BYTES
    # An adapter's parameters, at most this fraction of its backbone's.
    max_backbone_fraction: float = DEFAULT_MAX_BACKBONE_FRACTION

    def __post_init__(self) -> None:
        if self.max_tenant_bytes < 1:
            raise ValueError(f"max_tenant_bytes is {self.max_tenant_bytes}; it must be at least 1")
        if not 0 < self.max_backbone_fraction <= 1:
            raise ValueError(f"max_backbone_fraction is {self.max_backbone_fraction}; it must be in (0, 1]")


def check_adapter_size(adapter_dir: Path, backbone: str, backbone_parameters: int, limits: AdapterLimits) -> int:
    """Raise AdapterInvalid for a rank beyond its layer or an adapter too large for `backbone`; returns the bytes
    the adapter's files take."""
    weights = Path(adapter_dir) / WEIGHTS_FILE
    try:
        header = read_safetensors_header(weights)
    except MalformedModel as exc:
        raise AdapterInvalid(exc.message) from exc
    for name, tensor in sorted(header.tensors.items()):
        if name.endswith(LORA_A_SUFFIX) and len(tensor.shape) == 2:
            rank, in_features = tensor.shape
            partner = header.tensors.get(name.removesuffix(LORA_A_SUFFIX) + ".lora_B.weight")
            out_features = partner.shape[0] if partner is not None and len(partner.shape) == 2 else in_features
            if rank > min(in_features, out_features):
                module = name.removesuffix(LORA_A_SUFFIX).removeprefix(PEFT_PREFIX)
                raise AdapterInvalid(
                    f"module {module} has rank {rank}, more than its layer's {in_features} x {out_features} can "
                    f"use (at most {min(in_features, out_features)}); lower r"
                )
    allowed = int(backbone_parameters * limits.max_backbone_fraction)
    if header.num_parameters > allowed:
        raise AdapterInvalid(
            f"the adapter has {header.num_parameters:,} parameters; an adapter for backbone {backbone!r} "
            f"({backbone_parameters:,}) may have at most {allowed:,} ({limits.max_backbone_fraction:g} of it)"
        )
    return sum(p.stat().st_size for p in Path(adapter_dir).iterdir() if p.is_file())


def check_tenant_quota(tenant: str, used_bytes: int, new_bytes: int, limits: AdapterLimits) -> None:
    """QuotaExceeded (413) if storing `new_bytes` more would take `tenant` past its adapter storage quota."""
    if used_bytes + new_bytes > limits.max_tenant_bytes:
        raise QuotaExceeded(
            f"tenant {tenant!r}'s adapters take {used_bytes:,} bytes; this one ({new_bytes:,} bytes) would pass "
            f"the quota of {limits.max_tenant_bytes:,} bytes; delete functions it no longer needs"
        )
