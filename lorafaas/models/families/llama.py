"""The Llama family's layout (Llama, Mistral, Qwen2, SmolLM): the one module that knows which linear layers a decoder
layer has and what they are called, how they group in the shared base pass, where its norms and LM head are, and
how the part of a decoder layer after attention (a layer tail, `lorafaas.protocols.base_pass.GroupSpec.tail`) is
computed. Used by a function's decode step (`lorafaas.function_runtime.decode_step`), the base pass's client
(`lorafaas.function_runtime.base_pass`), its groups (`lorafaas.models.base_pass_groups`) and the daemon's executor
(`lorafaas.backbone_daemon.base_pass`), so that they agree on the layout and give the same numbers.

A model's layout: `model.model` is the decoder (`embed_tokens`, `rotary_emb`, `layers`, the final `norm`),
`model.lm_head` the LM head; each decoder layer has `input_layernorm`, `self_attn` (q, k, v and o_proj),
`post_attention_layernorm` and `mlp` (gate, up and down_proj).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = "self_attn"
QKV = ("q_proj", "k_proj", "v_proj")  # one input: one call in the shared base pass
O_PROJ = "o_proj"
MLP = "mlp"
MLP_LAYERS = ("gate_proj", "up_proj", "down_proj")
INPUT_NORM = "input_layernorm"
POST_ATTENTION_NORM = "post_attention_layernorm"
LM_HEAD = "lm_head"

# Linear layers of one decoder layer that take the same input, by their paths in the layer: one call each in the
# shared base pass. Any other linear layer is a group of its own.
SHARED_INPUT = (tuple(f"{ATTENTION}.{name}" for name in QKV), tuple(f"{MLP}.{name}" for name in MLP_LAYERS[:2]))
# MLP classes whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)): with a SiLU and no biases the executor
# computes such an MLP whole, one call instead of two (`GroupSpec.mlp_down`)
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP")
SILU = ("SiLU", "SiLUActivation")


# -- where things are --------------------------------------------------------------------------------------------------

def decoder(model: nn.Module) -> Any:
    """The model's decoder (`LlamaModel`: embed_tokens, rotary_emb, layers, norm), or None."""
    return getattr(model, "model", None)


def decoder_layers(model: nn.Module) -> Any:
    """The model's decoder layers (an `nn.ModuleList`), or None."""
    return getattr(decoder(model), "layers", None)


def final_norm(model: nn.Module) -> Any:
    """The norm after the last decoder layer, or None."""
    return getattr(decoder(model), "norm", None)


def lm_head(model: nn.Module) -> Any:
    """The LM head (a linear layer, or a LoRA wrapper of one), or None."""
    return getattr(model, LM_HEAD, None)


def attention(layer: nn.Module) -> Any:
    return getattr(layer, ATTENTION, None)


def mlp(layer: nn.Module) -> Any:
    return getattr(layer, MLP, None)


def input_norm(layer: nn.Module) -> Any:
    return getattr(layer, INPUT_NORM, None)


def post_attention_norm(layer: nn.Module) -> Any:
    return getattr(layer, POST_ATTENTION_NORM, None)


def qkv_layers(layer: nn.Module) -> tuple[Any, Any, Any]:
    """A decoder layer's q, k and v projections (as the model holds them: bare, or LoRA-wrapped)."""
    attending = attention(layer)
    q, k, v = (getattr(attending, name, None) for name in QKV)
    return q, k, v


def o_proj(layer: nn.Module) -> Any:
    return getattr(attention(layer), O_PROJ, None)


def mlp_layers(module: nn.Module) -> tuple[Any, Any, Any]:
    """An MLP's gate, up and down projections (as it holds them), None for those it lacks."""
    gate, up, down = (getattr(module, name, None) for name in MLP_LAYERS)
    return gate, up, down


def is_gated_mlp(module: nn.Module) -> bool:
    """Whether `module` is an MLP of the family computing down(silu(gate(x)) * up(x)) (`GATED_MLPS`, a SiLU)."""
    return type(module).__name__ in GATED_MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU


def gate_path(mlp_path: str) -> str:
    """The path of a gated MLP's gate layer, which names the MLP's group."""
    return f"{mlp_path}.{MLP_LAYERS[0]}"


def mlp_prefix(gate_layer_path: str) -> str:
    """The path prefix of the MLP whose gate is at `gate_layer_path` (its layers are prefix + `MLP_LAYERS`)."""
    return gate_layer_path.removesuffix(MLP_LAYERS[0])


# -- what a layer computes ---------------------------------------------------------------------------------------------

def rms_norm(weight: torch.Tensor, eps: float, hidden: torch.Tensor) -> torch.Tensor:
    """`LlamaRMSNorm.forward`'s operations, in its order and dtypes."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(dtype)


def norm(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """A `LlamaRMSNorm` module's forward, without a module call."""
    return rms_norm(module.weight, module.variance_epsilon, hidden)


def gated_mlp(linear: Callable[..., torch.Tensor], x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """`LlamaMLP.forward` with a SiLU and no biases: down(silu(gate(x)) * up(x))."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def layer_tail(linear: Callable[..., torch.Tensor], attended: torch.Tensor, hidden: torch.Tensor,
               o_delta: torch.Tensor, o_weight: torch.Tensor, post_norm: torch.Tensor, eps: float,
               mlp_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The residual stream after a layer's o_proj (its LoRA delta added as `LoraLinear` adds it) and its MLP."""
    o = linear(attended, o_weight)
    hidden = hidden + (o + o_delta).to(o.dtype)
    return hidden + gated_mlp(linear, rms_norm(post_norm, eps, hidden), *mlp_weights)


# -- Hugging Face's classes --------------------------------------------------------------------------------------------

def is_plain_hf_llama(model: nn.Module) -> bool:
    """Whether `model` is Hugging Face's `LlamaForCausalLM` with every module of its layout of HF's own Llama class
    (none replaced whole by an adapter), as many decoder layers as its config says; False without those classes."""
    try:
        from transformers.models.llama.modeling_llama import (
            LlamaAttention,
            LlamaDecoderLayer,
            LlamaForCausalLM,
            LlamaModel,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )
    except ImportError:  # a transformers without them
        return False
    if type(model) is not LlamaForCausalLM:
        return False
    inner = decoder(model)
    if (type(inner) is not LlamaModel or type(inner.rotary_emb) is not LlamaRotaryEmbedding
            or type(inner.norm) is not LlamaRMSNorm or len(inner.layers) != model.config.num_hidden_layers):
        return False
    return all(type(layer) is LlamaDecoderLayer and type(attention(layer)) is LlamaAttention
               and type(input_norm(layer)) is LlamaRMSNorm and type(post_attention_norm(layer)) is LlamaRMSNorm
               for layer in inner.layers)
