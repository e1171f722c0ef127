"""The LoRA server's per-client rules (`lorafaas.lora_server.client_policy`): budgets, rows per batch, connections."""

from __future__ import annotations

import pytest

from lorafaas.lora_server.client_policy import ClientLimits, ClientPolicy

A, B = ("pid", 1), ("pid", 2)


def test_a_client_that_spent_its_budget_waits_and_the_others_go_on() -> None:
    policy = ClientPolicy(ClientLimits(share=0.25, burst_s=0.25))
    chosen, waiting = policy.select([(A, 10, False), (B, 10, False)], now=0.0)
    assert chosen == [0, 1] and waiting == []
    policy.charge([(A, 99.0), (B, 1.0)], seconds=1.0, now=1.0)  # A's call was 99 % of the batch
    chosen, waiting = policy.select([(A, 10, False), (B, 10, False)], now=1.0)
    assert chosen == [1] and waiting == [0]
    assert policy.num_deferred == 1
    policy.select([(A, 10, True)], now=1.0)
    assert policy.num_deferred == 1  # a call is counted once however long it waits
    refill = policy.next_refill([A], now=1.0)
    assert refill > 1.0
    assert policy.select([(A, 10, True)], now=refill)[0] == [0]


def test_a_client_pays_in_proportion_to_its_rows_and_width() -> None:
    policy = ClientPolicy(ClientLimits(share=0.5, burst_s=1.0))
    policy.charge([(A, 3.0), (B, 1.0)], seconds=1.0, now=0.0)
    assert policy._bucket(A, 0.0).seconds == pytest.approx(0.25)
    assert policy._bucket(B, 0.0).seconds == pytest.approx(0.75)


def test_one_clients_rows_in_a_batch_are_bounded_but_its_first_call_always_fits() -> None:
    policy = ClientPolicy(ClientLimits(max_rows_per_batch=100))
    chosen, waiting = policy.select([(A, 500, False), (A, 10, False), (B, 60, False), (B, 60, False)], now=0.0)
    assert chosen == [0, 2] and waiting == []


def test_connections_per_client_are_capped_and_freed() -> None:
    policy = ClientPolicy(ClientLimits(max_connections=2))
    assert policy.connect(A, 0.0) and policy.connect(A, 0.0)
    assert not policy.connect(A, 0.0)
    assert policy.connect(B, 0.0)
    policy.disconnect(A)
    assert policy.connect(A, 0.0)


def test_a_debt_outlives_the_clients_connections() -> None:
    policy = ClientPolicy(ClientLimits(share=0.25, burst_s=0.25))
    policy.connect(A, 0.0)
    policy.charge([(A, 1.0)], seconds=2.0, now=0.0)
    policy.disconnect(A)
    policy.connect(A, 0.0)  # reconnecting does not refill it
    assert policy.select([(A, 1, False)], now=0.0) == ([], [0])


def test_limits_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError):
        ClientLimits(share=0.0)
    with pytest.raises(ValueError):
        ClientLimits(send_timeout_s=0)


def test_adapter_registrations_per_client_are_capped_across_connections() -> None:
    policy = ClientPolicy(ClientLimits(max_adapters=2))
    assert policy.connect(A, 0.0) and policy.connect(A, 0.0)
    assert policy.take_adapter(A, 0.0) and policy.take_adapter(A, 0.0)
    assert not policy.take_adapter(A, 0.0)
    assert policy.take_adapter(B, 0.0)
    policy.give_adapters(A, 1)
    assert policy.take_adapter(A, 0.0)
