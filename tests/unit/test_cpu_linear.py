"""oneDNN as the kernel of a float32 backbone's linear products (lorafaas/models/cpu_linear.py): the same layers,
the same answers within float32 roundings, an adapter wraps them as before, and the daemon's choice is explained."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lorafaas.models.cpu_linear import (
    OneDnnLinear,
    choose_cpu_linear,
    is_bare_linear,
    onednn_available,
    onednn_linear,
    use_onednn_linears,
)
from lorafaas.models.lora import attach_adapter, read_host_adapter
from lorafaas.models.reference import load_backbone, with_adapter

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7], [8, 1, 64, 12, 230, 4, 19]])


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (2, 5, 48), (0, 48), (1, 0, 48)])
def test_onednn_linear_computes_what_f_linear_computes(shape) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(80, 48), torch.randn(80)
    x = torch.randn(*shape)
    ours, reference = onednn_linear(x, weight, bias), F.linear(x, weight, bias)
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    transposed = torch.randn(48, 3).t()  # not contiguous
    torch.testing.assert_close(onednn_linear(transposed, weight), F.linear(transposed, weight), rtol=1e-5, atol=1e-5)


def test_with_gradients_wanted_it_computes_as_nn_linear_and_gradients_flow() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(48, 32)
    reference = nn.Linear(48, 32)
    reference.load_state_dict(layer.state_dict())
    layer.__class__ = OneDnnLinear
    x = torch.randn(4, 48, requires_grad=True)
    out = layer(x)
    assert torch.equal(out, reference(x))  # F.linear itself: oneDNN's op has no backward
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_only_plain_float32_linears_change_and_they_stay_linears(backbone_dir: Path) -> None:
    model, _ = load_backbone(backbone_dir)
    model.model.layers[0].self_attn.q_proj.to(torch.bfloat16)
    keys = list(model.state_dict())
    plain = [m for m in model.modules() if type(m) is nn.Linear]
    changed = use_onednn_linears(model)
    assert changed == len(plain) - 1  # the bf16 layer kept its kernel (torch's is oneDNN's already)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert type(model.model.layers[0].self_attn.k_proj) is OneDnnLinear
    assert all(isinstance(m, nn.Linear) and is_bare_linear(m) for m in plain)
    assert list(model.state_dict()) == keys


@pytest.fixture(scope="module")
def backbone_dir(tiny_store) -> Path:
    return tiny_store.path("tiny-dense")


def test_a_onednn_model_gives_the_logits_and_greedy_tokens_of_the_plain_one(backbone_dir: Path) -> None:
    plain, _ = load_backbone(backbone_dir)
    ours, _ = load_backbone(backbone_dir)
    assert use_onednn_linears(ours) > 0
    torch.testing.assert_close(logits(ours), logits(plain), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        greedy = [m.generate(IDS, max_new_tokens=12, do_sample=False) for m in (plain, ours)]
    assert torch.equal(*greedy)


def test_an_adapter_wraps_onednn_layers_and_equals_peft(backbone_dir: Path, tiny_adapter_dir: Path) -> None:
    ours, _ = load_backbone(backbone_dir)
    use_onednn_linears(ours)
    attach_adapter(ours, read_host_adapter(tiny_adapter_dir))
    wrapped = ours.model.layers[0].self_attn.q_proj
    assert type(wrapped.base) is OneDnnLinear and wrapped.lora_a is not None  # the adapter took the layer
    peft_model, _ = load_backbone(backbone_dir)
    peft_model = with_adapter(peft_model, tiny_adapter_dir)
    plain, _ = load_backbone(backbone_dir)
    reference = logits(peft_model)
    assert not torch.allclose(reference, logits(plain), rtol=1e-3, atol=1e-3), "the adapter must change the output"
    torch.testing.assert_close(logits(ours), reference, rtol=1e-5, atol=1e-5)


def test_the_choice_follows_the_setting_and_auto_is_measured() -> None:
    torch.set_num_threads(2)
    weights = [torch.randn(256, 128) for _ in range(4)] + [torch.randn(2048, 128)]
    assert choose_cpu_linear("torch", weights).kernel == "torch"
    assert choose_cpu_linear("onednn", weights).kernel == "onednn"
    no_float32 = choose_cpu_linear("auto", [w.to(torch.bfloat16) for w in weights])
    assert (no_float32.kernel, no_float32.reason) == ("torch", "no float32 CPU weights")
    measured = choose_cpu_linear("auto", weights)
    assert measured.kernel in ("torch", "onednn")
    assert "torch" in measured.reason and "oneDNN" in measured.reason and " ms" in measured.reason
    assert torch.get_num_threads() == 2, "measured on one thread, the caller's threads put back"
