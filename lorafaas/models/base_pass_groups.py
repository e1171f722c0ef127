"""The backbone's layer groups for the shared base pass (`lorafaas.protocols.base_pass.GroupSpec`), derived from a
model bound to the segment: what a member sends in its hello, and what the daemon's executor derives from the
backbone itself and checks every hello against (so no member decides them for the others)."""

from __future__ import annotations

import torch
from torch import nn

from lorafaas.models.cpu_linear import is_bare_linear
from lorafaas.models.families import llama
from lorafaas.protocols import base_pass as bp
from lorafaas.protocols.base_pass import BasePassUnavailable


def backbone_groups(model: nn.Module, tensors: dict[str, torch.Tensor]) -> tuple[bp.GroupSpec, ...]:
    """Every group of `model`'s backbone, in the order of a hello: the layer groups, then the layer tails."""
    groups = layer_groups(model, tensors)
    return tuple([spec for spec, _ in groups] + [spec for spec, _ in layer_tails(model, tensors, groups)])


def bare_linear(layer: object) -> nn.Linear | None:
    """The backbone's linear layer in `layer` (itself, or the `base` of a LoRA wrapper), or None."""
    base = getattr(layer, "base", layer)
    return base if is_bare_linear(base) else None


def gated_mlps(model: nn.Module, names: dict[int, str]) -> dict[str, nn.Module]:
    """Path of the gate layer -> its MLP, for each gated MLP (`llama.is_gated_mlp`) whose three layers are bound to
    the segment (`names`: data pointer -> the segment's name) without biases."""
    found = {}
    for path_of, module in model.named_modules():
        if not llama.is_gated_mlp(module):
            continue
        layers = [bare_linear(layer) for layer in llama.mlp_layers(module)]
        if all(layer is not None and layer.bias is None and layer.weight.data_ptr() in names for layer in layers):
            found[llama.gate_path(path_of)] = module
    return found


def layer_groups(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[tuple[bp.GroupSpec, list[nn.Linear]]]:
    """The groups of `model`'s backbone linear layers (those whose weights are `tensors`, the attached segment's), in
    module order, each with its layers (a gated MLP's: gate, up, down); raises BasePassUnavailable if there are
    none."""
    names = {t.data_ptr(): name for name, t in tensors.items()}
    found: dict[str, nn.Linear] = {}  # path -> layer, in module order (LoRA wrappers looked through)
    for path_of, module in model.named_modules():
        if is_bare_linear(module) and module.weight.data_ptr() in names:
            found[path_of.removesuffix(".base")] = module
    if not found:
        raise BasePassUnavailable("the model has no linear layer bound to the backbone's segment")
    mlps = gated_mlps(model, names)
    groups: list[tuple[bp.GroupSpec, list[nn.Linear]]] = []
    grouped: set[str] = set()
    for p in found:
        if p in grouped:
            continue
        if p in mlps:
            prefix = llama.mlp_prefix(p)
            layers = [found[prefix + name] for name in llama.MLP_LAYERS]
            grouped.update(prefix + name for name in llama.MLP_LAYERS)
            gate, up, down = (names[layer.weight.data_ptr()] for layer in layers)
            groups.append((bp.GroupSpec(weights=(gate, up), biases=(None, None), mlp_down=down), layers))
            continue
        members = [p]
        for names_of_group in llama.SHARED_INPUT:
            prefix = p.removesuffix(names_of_group[0])
            if prefix != p and all(prefix + n in found for n in names_of_group):
                members = [prefix + n for n in names_of_group]
                break
        grouped.update(members)
        layers = [found[m] for m in members]
        biases = tuple(None if layer.bias is None else names.get(layer.bias.data_ptr()) for layer in layers)
        if any(b is None and layer.bias is not None for b, layer in zip(biases, layers, strict=True)):
            raise BasePassUnavailable(f"a bias of {members} is not in the backbone's segment")
        groups.append((bp.GroupSpec(weights=tuple(names[layer.weight.data_ptr()] for layer in layers),
                                    biases=biases), layers))
    return groups


def layer_tails(model: nn.Module, tensors: dict[str, torch.Tensor],
                groups: list[tuple[bp.GroupSpec, list[nn.Linear]]]) -> list[tuple[bp.GroupSpec, int]]:
    """A Llama's layer tails (`bp.GroupSpec.tail`), one a decoder layer, each with the key of the group whose
    products it ends with (the next layer's q/k/v, or the LM head); [] when the model's layers are not all of that
    shape in the segment (its decode steps then go group by group)."""
    names = {t.data_ptr(): name for name, t in tensors.items()}
    layers = llama.decoder_layers(model)
    final_norm = llama.final_norm(model)
    lm_head = bare_linear(llama.lm_head(model))
    if not layers or final_norm is None or lm_head is None:
        return []
    key_of = {spec.weights[0]: key for key, (spec, _) in enumerate(groups) if not spec.mlp_down}
    mlps = {id(mlp) for mlp in gated_mlps(model, names).values()}
    tails: list[tuple[bp.GroupSpec, int]] = []
    for index, layer in enumerate(layers):
        last = index == len(layers) - 1
        post_norm = llama.post_attention_norm(layer)
        next_norm = final_norm if last else llama.input_norm(layers[index + 1])
        o_proj = bare_linear(llama.o_proj(layer))
        mlp = llama.mlp(layer)
        if o_proj is None or o_proj.bias is not None or mlp is None or id(mlp) not in mlps:
            return []
        norms = [getattr(norm, "weight", None) for norm in (post_norm, next_norm)]
        eps = {getattr(norm, "variance_epsilon", None) for norm in (post_norm, next_norm)}
        if any(w is None or w.data_ptr() not in names for w in norms) or len(eps) != 1 or None in eps:
            return []
        following = lm_head if last else bare_linear(llama.qkv_layers(layers[index + 1])[0])
        key = None if following is None else key_of.get(names.get(following.weight.data_ptr(), ""))
        if key is None or (not last and len(groups[key][1]) != 3):
            return []
        spec = groups[key][0]
        gate, up, down = (names[bare_linear(layer).weight.data_ptr()] for layer in llama.mlp_layers(mlp))
        tails.append((bp.GroupSpec(weights=spec.weights, biases=spec.biases, tail=bp.LayerTail(
            o_proj=names[o_proj.weight.data_ptr()], post_norm=names[norms[0].data_ptr()],
            gate=gate, up=up, down=down, next_norm=names[norms[1].data_ptr()],
            eps=float(eps.pop()))), key))
    return tails


