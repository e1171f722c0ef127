"""Adapter size limits: a rank no larger than its layer, parameters at most a fraction of the backbone's, a quota."""

from pathlib import Path

import pytest

from lorafaas.errors import AdapterInvalid, QuotaExceeded
from lorafaas.platform.adapter_limits import AdapterLimits, check_adapter_size, check_tenant_quota
from lorafaas.testing.hostile import zero_adapter

BACKBONE_PARAMETERS = 106_816  # the tiny dense backbone


def test_a_rank_beyond_its_layer_is_refused_naming_the_module(tmp_path: Path, tiny_dense_dir: Path) -> None:
    adapter = zero_adapter(tmp_path / "a", tiny_dense_dir, rank=33, base_model_name="tiny-dense", num_layers=1)
    with pytest.raises(AdapterInvalid, match=r"model.layers.0.self_attn.v_proj has rank 33.*at most 32"):
        check_adapter_size(adapter, "tiny-dense", BACKBONE_PARAMETERS, AdapterLimits())


def test_an_adapter_within_the_limits_reports_its_bytes(tmp_path: Path, tiny_dense_dir: Path) -> None:
    adapter = zero_adapter(tmp_path / "a", tiny_dense_dir, rank=32, base_model_name="tiny-dense")
    stored = check_adapter_size(adapter, "tiny-dense", BACKBONE_PARAMETERS, AdapterLimits())
    assert stored == sum(p.stat().st_size for p in adapter.iterdir())
    with pytest.raises(AdapterInvalid, match="may have at most 10,681"):
        check_adapter_size(adapter, "tiny-dense", BACKBONE_PARAMETERS, AdapterLimits(max_backbone_fraction=0.1))


def test_the_tenant_quota() -> None:
    limits = AdapterLimits(max_tenant_bytes=1000)
    check_tenant_quota("acme", 600, 400, limits)
    with pytest.raises(QuotaExceeded, match=r"tenant 'acme'.*600 bytes.*401 bytes.*quota of 1,000 bytes") as err:
        check_tenant_quota("acme", 600, 401, limits)
    assert err.value.http_status == 413
    with pytest.raises(ValueError, match="max_backbone_fraction"):
        AdapterLimits(max_backbone_fraction=0)
