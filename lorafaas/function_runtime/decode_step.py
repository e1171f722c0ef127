"""One decode step of a Llama-family model (one new token a row) without Hugging Face's per-module plumbing.

A function's step at one row is mostly small operations: in the shared base pass the products are the executor's,
and what is left of a member's step (18-20 ms of CPU on SmolLM2 bf16) is a few of them a layer, wrapped in HF's
decorators, keyword plumbing and module calls, paid once per layer per step by every isolated function.
`decode_step` runs the same operations in the same order: the model's own embedding, rotary, linear and MLP modules
(so a LoRA wrapper or the base pass's remote layers act as they do under HF), HF's own mask, rotary and cache
functions, and the RMS norms inline with `LlamaRMSNorm`'s operations, without the wrapping (2-3 ms less;
docs/performance.md). Its logits equal HF's bit for bit (`tests/unit/test_decode_step.py`).

The attention is HF's own `sdpa_attention_forward`. For one unpadded row it takes SDPA's `enable_gqa`, whose bfloat16
CPU kernel costs about 100 us a layer where the packed kernel HF uses for a padded batch costs 22 us; but their
results differ by up to a float32 rounding, so a row would no longer get PEFT's logits bit for bit. Kept as HF does.

A model of another shape, an attention other than SDPA, or a module an adapter replaced whole (a norm, the rotary
embedding) makes `decode_step` answer None, and the engine runs HF's forward as before. Checked at each step: an
adapter attached after the engine was made is seen.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lorafaas.function_runtime.base_pass import BasePassClient, fused_pass
from lorafaas.models.families import llama

try:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    # the transformers 5.2x signatures (`cache=`); older versions take `past_key_values` and `cache_position`
    SUPPORTED = "cache" in inspect.signature(create_causal_mask).parameters
except ImportError:  # a transformers without these: HF's forward only
    SUPPORTED = False


def decode_step(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache, base_pass: BasePassClient | None = None) -> torch.Tensor | None:
    """The logits [rows, 1, vocab] of one decode step, the cache updated in place as HF's forward does; None when
    `model` is not a plain Llama this step can run (then run HF's forward). `base_pass`: the shared base pass the
    model's layers were installed in (`base_pass.install`), whose layer tails the step may go through."""
    if not _plain_llama(model):
        return None
    inner = llama.decoder(model)  # a LlamaModel (_plain_llama checked it)
    hidden = inner.embed_tokens(input_ids)
    mask = create_causal_mask(config=inner.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                              position_ids=position_ids)
    cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)
    rows = hidden.shape[0]
    tails = fused_pass(model, base_pass)  # in the shared base pass: one call a layer from its o_proj to the next q/k/v
    normed = None
    for index, layer in enumerate(inner.layers):
        attention = llama.attention(layer)
        if normed is None:
            normed = llama.norm(llama.input_norm(layer), hidden)
        shape = (rows, 1, -1, attention.head_dim)
        q_proj, k_proj, v_proj = llama.qkv_layers(layer)
        query = q_proj(normed).view(shape).transpose(1, 2)
        key = k_proj(normed).view(shape).transpose(1, 2)
        value = v_proj(normed).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        key, value = cache.update(key, value, attention.layer_idx)
        attended, _ = sdpa_attention_forward(attention, query, key, value, mask, dropout=0.0,
                                             scaling=attention.scaling)
        attended = attended.reshape(rows, 1, -1).contiguous()
        o_proj = llama.o_proj(layer)
        if tails is not None:
            tail = tails.call(index, o_proj, attended, hidden)
            if isinstance(tail, torch.Tensor):  # after the last layer: the logits
                return tail
            if tail is not None:
                hidden, normed = tail
                continue
            tails = None  # this pass is computed here (ALONE), or the executor went away: as below from now on
        hidden = hidden + o_proj(attended)
        hidden = hidden + llama.mlp(layer)(llama.norm(llama.post_attention_norm(layer), hidden))
        normed = None
    return llama.lm_head(model)(llama.norm(llama.final_norm(model), hidden))


def _plain_llama(model: nn.Module) -> bool:
    if not SUPPORTED or model.training or not llama.is_plain_hf_llama(model):
        return False
    config: Any = model.config  # a LlamaConfig (is_plain_hf_llama checked the model's class)
    return config._attn_implementation == "sdpa"
