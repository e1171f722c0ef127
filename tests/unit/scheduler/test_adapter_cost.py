"""Rank-aware costs (`adapter_cost.AdapterCostModel`): a rank-64 all-linear adapter is not a rank-4 q/v one, unless
the scheduler is told to be rank-blind."""

from __future__ import annotations

import pytest

from lorafaas.scheduler import AdapterCostModel, AdapterShape, BackboneShape, SchedulerConfig
from lorafaas.scheduler.adapter_cost import ALL_LINEAR

LLAMA2_7B = BackboneShape(hidden=4096, intermediate=11008, num_layers=32, kv_dim=4096, num_params=6_740_000_000)
BIG = AdapterShape(64, ALL_LINEAR)
SMALL = AdapterShape(4, ("q_proj", "v_proj"))
DISK_BYTES_PER_S = 5e9


def test_a_rank_64_all_linear_adapter_costs_more_step_and_cold_start_time_than_rank_4_q_v() -> None:
    model = AdapterCostModel(SchedulerConfig())
    assert model.adapter_bytes(SMALL, LLAMA2_7B) == 4 * 2 * (4096 + 4096) * 32 * 2  # 4.2 MB
    assert model.adapter_bytes(BIG, LLAMA2_7B) > 70 * model.adapter_bytes(SMALL, LLAMA2_7B)
    assert model.step_factor(BIG, LLAMA2_7B) > model.step_factor(SMALL, LLAMA2_7B) > 1.0
    assert model.cold_start_s(BIG, LLAMA2_7B, DISK_BYTES_PER_S) > 50 * model.cold_start_s(SMALL, LLAMA2_7B,
                                                                                           DISK_BYTES_PER_S)
    assert model.extra_flops_per_token(BIG, LLAMA2_7B) == 2 * model.adapter_bytes(BIG, LLAMA2_7B) // 2


def test_rank_blind_prices_every_adapter_the_same() -> None:
    model = AdapterCostModel(SchedulerConfig(rank_aware=False))
    assert model.adapter_bytes(BIG, LLAMA2_7B) == model.adapter_bytes(SMALL, LLAMA2_7B)
    assert model.step_factor(BIG, LLAMA2_7B) == model.step_factor(SMALL, LLAMA2_7B)
    assert model.cold_start_s(BIG, LLAMA2_7B, DISK_BYTES_PER_S) == model.cold_start_s(SMALL, LLAMA2_7B,
                                                                                      DISK_BYTES_PER_S)


def test_bad_shapes_and_settings_are_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match="rank is 0"):
        AdapterShape(0, ("q_proj",))
    with pytest.raises(ValueError, match="unknown LoRA target module 'lm_head'"):
        AdapterCostModel().adapter_bytes(AdapterShape(8, ("lm_head",)), LLAMA2_7B)
    with pytest.raises(ValueError, match="rank_blind_rank is 0"):
        SchedulerConfig(rank_blind_rank=0)
