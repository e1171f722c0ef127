"""The gateway's upload slots: a cap for the gateway and a smaller one per tenant: no tenant holds them all."""

from __future__ import annotations

import pytest

from lorafaas.errors import InvalidInput
from lorafaas.platform.gateway.limits import RequestLimits, UploadSlots


def test_a_tenant_holds_at_most_its_share_and_the_gateway_at_most_its_cap() -> None:
    slots = UploadSlots(max_total=4, max_per_tenant=2)
    assert slots.try_take("a") is None and slots.try_take("a") is None
    assert "this tenant has 2" in slots.try_take("a")
    assert slots.try_take("b") is None and slots.try_take("b") is None
    assert "4 adapter uploads are in progress" in slots.try_take("c")
    slots.give_back("a")
    assert slots.try_take("c") is None
    for tenant in ("a", "b", "b", "c"):
        slots.give_back(tenant)
    assert slots.held == {} and slots.num_held == 0


@pytest.mark.parametrize("fields", [{"max_uploads_per_tenant": 5}, {"max_uploads_per_tenant": 0},
                                    {"upload_timeout_s": 0}, {"upload_min_rate_bytes_s": 0}])
def test_limits_out_of_bounds_are_refused(fields) -> None:
    with pytest.raises(InvalidInput):
        RequestLimits(**fields)
