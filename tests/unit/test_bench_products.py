"""`lorafaas bench products` on the tiny seeded backbone: the cases it reports, figures consistent with each other and
with the backbone's weights, and clear errors for bad options."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lorafaas.bench.products import run_products_bench
from lorafaas.cli import main
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.packed_weights import packing_available
from lorafaas.testing.tiny_models import build_tiny_model


def _linear_bytes(dtype: torch.dtype) -> int:
    """Every linear weight of the tiny backbone once (the LM head's too): what one round reads."""
    model, _ = build_tiny_model("dense", 0)
    weights = {m.weight.data_ptr(): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(w.numel() * torch.finfo(dtype).bits // 8 for w in weights.values())


def test_every_case_reports_the_rounds_bytes_and_consistent_rates(tiny_store: ModelStore) -> None:
    home = tiny_store.models_dir.parent
    result = run_products_bench(home, "tiny-dense", rows=(1, 3), dtypes=("float32", "bfloat16"), repeats=2)

    assert [(c.dtype, c.rows) for c in result.cases] == [("float32", 1), ("float32", 3), ("bfloat16", 1),
                                                          ("bfloat16", 3)]
    layers = build_tiny_model("dense", 0)[0].config.num_hidden_layers
    assert result.groups_per_round == 1 + layers  # layer 0's q/k/v, then one tail a layer
    assert result.repeats == 2 and "thread" in result.streaming_method
    for case in result.cases:
        assert case.weight_bytes == _linear_bytes(getattr(torch, case.dtype))
        assert case.products_s > 0 and case.streaming_s > 0 and case.threads >= 1
        assert case.products_gb_s == pytest.approx(case.weight_bytes / case.products_s / 1e9)
        assert case.streaming_gb_s == pytest.approx(case.weight_bytes / case.streaming_s / 1e9)
        assert case.ratio_products_over_streaming > 0
    # as the daemon lays the weights out by default: packed for oneDNN in the segment where this torch can
    kernels = {c.kernel for c in result.cases}
    assert kernels == {"packed"} if packing_available() else kernels <= {"torch", "onednn", "onednn-packed-bf16"}


def test_a_plain_layout_is_benched_when_the_setting_asks_for_it(tiny_store: ModelStore,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAFAAS_CPU_LINEAR", "torch")
    result = run_products_bench(tiny_store.models_dir.parent, "tiny-dense", rows=(2,), dtypes=("float32",), repeats=1)
    assert [c.kernel for c in result.cases] == ["torch"]


def test_the_cli_prints_json(tiny_store: ModelStore, capsys: pytest.CaptureFixture[str]) -> None:
    home = str(tiny_store.models_dir.parent)
    with pytest.raises(SystemExit) as exited:
        main(["--home", home, "bench", "products", "--backbone", "tiny-dense", "--rows", "2", "--dtype", "float32",
              "--repeats", "1", "--json"])
    assert exited.value.code in (0, None)
    document = json.loads(capsys.readouterr().out)
    assert [(c["dtype"], c["rows"]) for c in document["cases"]] == [("float32", 2)]


@pytest.mark.parametrize(("args", "message"), [
    (["--rows", "0"], "--rows has 0"),
    (["--rows", "1,x"], "--rows has 'x'"),
    (["--dtype", "float64"], "--dtype has 'float64'"),
    (["--repeats", "0"], "--repeats is 0"),
    (["--backbone", "no-such-backbone"], "no-such-backbone"),
])
def test_bad_options_exit_2_with_the_reason(tiny_store: ModelStore, capsys: pytest.CaptureFixture[str],
                                            args: list[str], message: str) -> None:
    home = str(tiny_store.models_dir.parent)
    with pytest.raises(SystemExit) as exited:
        main(["--home", home, "bench", "products", "--backbone", "tiny-dense", *args])
    assert exited.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())
