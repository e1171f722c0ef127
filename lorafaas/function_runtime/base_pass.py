"""A function instance's side of the shared base pass (`lorafaas.protocols.base_pass`): the backbone's linear layers
computed by the device's executor together with other functions' rows.

`install(model, tensors, path)` puts a `RemoteForward` in front of every backbone linear layer the model binds from
the segment (inside `LoraLinear`, whose LoRA delta stays here, or bare, like an untargeted `lm_head`). A forward pass
then sends each group's input (q, k and v share one) to the executor and reads the outputs back. A gated MLP goes
whole (`RemoteMLP`: gate, up, SiLU and down in one call) unless the adapter wraps one of its layers; then the MLP is
computed here and its call carries 0 rows. When the executor answers ALONE at a pass's start, or cannot be reached,
the pass runs here as before, from this process's own read-only mapping of the same weights, so the results are
those of the same linear layers.

A decode step (`decode_step`) of a Llama whose adapter wraps at most q, k, v and o_proj goes through the layer tails
instead (`fused_pass`, `LayerTails.call`): one call a decoder layer, carrying the attention's output, the residual
stream and the o_proj LoRA delta computed here, and bringing back the residual stream, the next layer's normed input
and its q, k and v products (the LM head's logits after the last layer). The q, k and v layers then take those
products (`RemoteForward`, primed) and add their LoRA deltas as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import socket

import msgspec
import torch
from torch import nn

from lorafaas.models.cpu_linear import is_bare_linear
from lorafaas.models.lora import LoraLinear, adapter_version
from lorafaas.protocols import base_pass as bp
from lorafaas.wire import FRAME_HEADER_BYTES, encode_frame, frame_length

log = logging.getLogger(__name__)
_welcome_decoder = msgspec.msgpack.Decoder(bp.BasePassWelcome)

# Linear layers of one decoder layer that take the same input, by their names in the Llama family (Llama, Mistral,
# Qwen2, SmolLM): one call each. Any other linear layer is a group of its own.
SHARED_INPUT = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
# MLP classes whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)): with a SiLU and no biases the executor
# computes such an MLP whole, one call instead of two (`GroupSpec.mlp_down`)
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP")
SILU = ("SiLU", "SiLUActivation")
MLP_LAYERS = ("gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_ROWS = 256
CALL_TIMEOUT_S = 30.0


class BasePassUnavailable(Exception):
    pass


class BasePassClient:
    """One member's connection and buffer. Used by the compute thread only."""

    def __init__(self, path: str, groups: list[bp.GroupSpec], widths: list[tuple[int, list[int]]], dtype: torch.dtype,
                 max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.path = path
        self.groups = groups
        self.widths = widths  # per group: (in, [out of each layer])
        self.dtype = dtype
        self.max_rows = max_rows
        self.broken = False
        self.alone = False  # this pass runs here (the executor said ALONE)
        self.local = False  # this step runs here (the step gate granted cores, not the shared pass)
        self._awaited = False  # the executor was told another step follows: it may hold a round for this member
        self.fused = False  # this pass goes through the layer tails (the executor took its FUSED start)
        self._fuse_next = False  # the next pass start asks for the layer tails
        self.first_tail = next((key for key, group in enumerate(groups) if group.tail), len(groups))
        self.num_calls = 0
        self.num_fused_passes = 0
        self.tails: LayerTails | None = None  # set by `install` when the model has them
        self.num_skips = 0  # gated-MLP calls with 0 rows: this member computed the MLP itself
        self.num_alone_passes = 0
        name = str(dtype).removeprefix("torch.")
        max_in = max(w for w, _ in widths)
        max_out = max(sum(outs) for _, outs in widths)
        output_offset, size = bp.buffer_layout(max_rows, max_in, max_out, name)
        self._fd = os.memfd_create("lorafaas-base-pass", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, size)
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)  # the executor maps it: never shorter
        self._buffer = mmap.mmap(self._fd, size)
        self._flat = torch.frombuffer(self._buffer, dtype=dtype)
        self._output_offset = output_offset // bp.ELEMENT_BYTES[name]
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(CALL_TIMEOUT_S)
        try:
            self._sock.connect(path)
            socket.send_fds(self._sock, [encode_frame(bp.BasePassHello(groups=tuple(groups), max_rows=max_rows,
                                                                          dtype=name))], [self._fd])
            welcome = _welcome_decoder.decode(self._read_frame())
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            self.close()
            raise BasePassUnavailable(f"the base pass at {path} cannot be reached: {exc}") from exc
        if not welcome.accepted:
            self.close()
            raise BasePassUnavailable(f"the base pass at {path} refused this instance: {welcome.message}")

    def call(self, key: int, x: torch.Tensor) -> list[torch.Tensor] | None:
        """The outputs of group `key` for x [..., in], or None: compute it here (ALONE, or the executor is gone)."""
        if self.broken or self.local or (self.alone and key != 0):
            return self._pass_over(key, None)
        width, outs = self.widths[key]
        rows = x.reshape(-1, width)
        results: list[list[torch.Tensor]] = [[] for _ in outs]
        fuse, self._fuse_next = key == 0 and self._fuse_next, False
        try:
            for start in range(0, max(rows.shape[0], 1), self.max_rows):
                chunk = rows[start:start + self.max_rows]
                n = chunk.shape[0]
                self._flat[: n * width].view(n, width).copy_(chunk)
                flags = bp.CONTINUATION if start else bp.FUSED if fuse else 0
                self._sock.sendall(bp.HEADER.pack(key, n, flags))
                reply = self._sock.recv(1)
                if reply == bp.ALONE and key == 0 and not start:
                    self.alone = True
                    self.num_alone_passes += 1
                    return self._pass_over(key, None)
                if reply != bp.DONE:
                    raise ConnectionError(f"the executor answered {reply!r}")
                if fuse and not start:
                    self.fused = True
                    self.num_fused_passes += 1
                offset = self._output_offset
                for i, out in enumerate(outs):
                    results[i].append(self._flat[offset:offset + n * out].view(n, out).clone())
                    offset += n * out
        except OSError as exc:
            self._fail(exc)
            return self._pass_over(key, None)
        self.num_calls += 1
        lead = x.shape[:-1]
        return self._pass_over(key, [torch.cat(r).view(*lead, r[0].shape[1]) if len(r) > 1 else r[0].view(*lead, -1)
                                     for r in results])

    def skip(self, key: int) -> None:
        """Keep this member's place in the round at gated-MLP group `key`, which it computes itself (its adapter
        wraps a layer of it): a call with 0 rows, answered DONE."""
        if not (self.broken or self.local or self.alone):
            try:
                self._sock.sendall(bp.HEADER.pack(key, 0, 0))
                reply = self._sock.recv(1)
                if reply != bp.DONE:
                    raise ConnectionError(f"the executor answered {reply!r}")
                self.num_skips += 1
            except OSError as exc:
                self._fail(exc)
        self._pass_over(key, None)

    def arm_fused(self) -> None:
        """The next pass start asks for the layer tails (`fused_pass`)."""
        self._fuse_next = True

    def begin_step(self, shared: bool) -> None:
        """Before each engine step: whether its backbone products go to the executor (else computed here)."""
        self.local = not shared
        if self.local and self._awaited:  # no round should wait for this member's pass start
            self._end(again=False)

    def end_step(self, again: bool) -> None:
        """After each engine step: whether this instance has another step to run."""
        self.alone = self.fused = self._fuse_next = False
        if self.tails is not None:
            self.tails.clear()
        if not self.local:
            self._end(again)
        self.local = False

    def _end(self, again: bool) -> None:
        if self.broken:
            return
        try:
            self._sock.sendall(bp.HEADER.pack(bp.END_KEY, 0, bp.AGAIN if again else 0))
            self._awaited = again
        except OSError as exc:
            self._fail(exc)

    def close(self) -> None:
        self._sock.close()
        self._flat = None
        with contextlib.suppress(BufferError):  # an output view still alive; the mapping goes with it
            self._buffer.close()
        os.close(self._fd)

    def _pass_over(self, key: int, outputs):
        if key in (self.first_tail - 1, len(self.groups) - 1):  # a pass's last group: the next call starts one
            self.alone = self.fused = False
        return outputs

    def _read_frame(self) -> bytes:
        header = self._recv_exactly(FRAME_HEADER_BYTES)
        return self._recv_exactly(frame_length(header))

    def _recv_exactly(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self._sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the executor closed the connection")
            data += chunk
        return bytes(data)

    def _fail(self, exc: BaseException) -> None:
        log.warning("base pass %s unusable (%s): computing every layer here from now on", self.path, exc)
        self.broken = True
        self._sock.close()


class RemoteForward:
    """The forward of a backbone linear layer whose product the executor computes, the layer's own as the fallback.
    Set on the layer itself (`layer.forward`), so the model's modules stay what they are and an adapter attached
    later wraps the layer as before. The first layer of a group calls the executor for the whole group; the others
    take their output when given the same input tensor (as the Llama family calls q, k and v), else compute here."""

    def __init__(self, layer: nn.Linear, client: BasePassClient, key: int, index: int, size: int,
                 shared: list) -> None:
        self.layer = layer
        self.client = client
        self.key = key
        self.index = index
        self.size = size  # layers in the group
        # [input, outputs] of the group's call, until its last layer takes its output: held longer, every group's
        # tensors of a prefill would stay alive between steps (about 100 MB a member on SmolLM2)
        self._shared = shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.index == 0 and not (self._shared[0] is x and self._shared[1] is not None):  # else a tail's products
            outputs = self.client.call(self.key, x)
            if self.size > 1:
                self._shared[:] = [x, outputs]
            return self._local(x) if outputs is None else outputs[0]
        given, outputs = self._shared
        if self.index == self.size - 1:
            self._shared[:] = [None, None]
        if outputs is None or given is not x:
            return self._local(x)
        return outputs[self.index]

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        return type(self.layer).forward(self.layer, x)  # nn.Linear's, or the kernel chosen for it (OneDnnLinear)


class RemoteMLP:
    """The forward of a gated MLP the executor computes whole (`GroupSpec.mlp_down`). While an adapter wraps one of
    its layers, the MLP is computed here with the adapter's deltas and the call goes with 0 rows (its place in the
    round); computed here too when the step or pass is (`BasePassClient.call` answers None)."""

    def __init__(self, mlp: nn.Module, client: BasePassClient, key: int) -> None:
        self.mlp = mlp
        self.client = client
        self.key = key

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        if all(is_bare_linear(getattr(mlp, name)) for name in MLP_LAYERS):
            outputs = self.client.call(self.key, x)
            if outputs is not None:
                return outputs[0]
        else:
            self.client.skip(self.key)
        return type(mlp).forward(mlp, x)


class LayerTails:
    """A member's layer tails (`bp.GroupSpec.tail`): `keys[i]` is decoder layer i's, and `qkv[i]` the shared slot of
    layer i's q/k/v group, which the tail before it fills with its products (`RemoteForward`)."""

    def __init__(self, client: BasePassClient, keys: list[int], qkv: list[list]) -> None:
        self.client = client
        self.keys = keys
        self.qkv = qkv
        self._checked: tuple[int, bool] | None = None  # (the model's adapter version, usable then)

    def usable(self, model: nn.Module) -> bool:
        """Whether this step's layers are the ones the tails compute: o_proj bare or with a LoRA of the backbone's
        dtype (its delta is sent in the buffer), MLPs and LM head bare, q/k/v through the pass. Checked again only
        when an adapter was attached or detached since (it takes about 0.5 ms on SmolLM2, every decode step)."""
        version = adapter_version(model)
        if self._checked is None or self._checked[0] != version:
            self._checked = (version, self._usable(model))
        return self._checked[1]

    def _usable(self, model: nn.Module) -> bool:
        dtype = self.client.dtype
        for layer in model.model.layers:
            o_proj, attention = layer.self_attn.o_proj, layer.self_attn
            if isinstance(o_proj, LoraLinear):
                if o_proj.lora_a is not None and {o_proj.lora_a.dtype, o_proj.lora_b.dtype} != {dtype}:
                    return False
                o_proj = o_proj.base
            if not is_bare_linear(o_proj) or not isinstance(layer.mlp.__dict__.get("forward"), RemoteMLP) \
                    or not all(is_bare_linear(getattr(layer.mlp, name)) for name in MLP_LAYERS):
                return False
            if not all(isinstance(getattr(_bare(getattr(attention, name)), "__dict__", {}).get("forward"),
                                  RemoteForward) for name in ("q_proj", "k_proj", "v_proj")):
                return False
        return is_bare_linear(model.lm_head)

    def call(self, index: int, o_proj: nn.Module, attended: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
        """Decoder layer `index`'s tail: (residual stream, next normed input) with the next q/k/v products primed,
        or after the last layer the logits; None when this pass is not fused (then compute here)."""
        if not self.client.fused:
            return None
        delta = o_proj.delta(attended) if isinstance(o_proj, LoraLinear) and o_proj.lora_a is not None else \
            torch.zeros_like(hidden)
        outputs = self.client.call(self.keys[index], torch.cat([attended, hidden, delta], dim=-1))
        if outputs is None:
            return None
        if index == len(self.keys) - 1:
            return outputs[2]
        self.qkv[index + 1][:] = [outputs[1], outputs[2:]]
        return outputs[0], outputs[1]

    def clear(self) -> None:
        for shared in self.qkv:
            shared[:] = [None, None]


def fused_pass(model: nn.Module) -> LayerTails | None:
    """The layer tails of `model`'s decode step about to start (its first call asks for them), or None: this step
    goes group by group (or is computed here)."""
    client = model.__dict__.get("_lorafaas_base_pass")
    tails = None if client is None else client.tails
    if tails is None or client.broken or client.local or client.alone or not tails.usable(model):
        return None
    client.arm_fused()
    return tails


def _bare(layer: nn.Module | None) -> nn.Linear | None:
    """The backbone's linear layer in `layer` (itself, or the `base` of a LoRA wrapper), or None."""
    base = getattr(layer, "base", layer)
    return base if is_bare_linear(base) else None


def gated_mlps(model: nn.Module, names: dict[int, str]) -> dict[str, nn.Module]:
    """Path of the gate layer -> its MLP, for each gated MLP (`GATED_MLPS`, a SiLU) whose three layers are bound to
    the segment (`names`: data pointer -> the segment's name) without biases."""
    found = {}
    for path_of, module in model.named_modules():
        if type(module).__name__ not in GATED_MLPS or type(getattr(module, "act_fn", None)).__name__ not in SILU:
            continue
        layers = [_bare(getattr(module, name, None)) for name in MLP_LAYERS]
        if all(layer is not None and layer.bias is None and layer.weight.data_ptr() in names for layer in layers):
            found[f"{path_of}.gate_proj"] = module
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
            prefix = p.removesuffix("gate_proj")
            layers = [found[prefix + name] for name in MLP_LAYERS]
            grouped.update(prefix + name for name in MLP_LAYERS)
            gate, up, down = (names[layer.weight.data_ptr()] for layer in layers)
            groups.append((bp.GroupSpec(weights=(gate, up), biases=(None, None), mlp_down=down), layers))
            continue
        members = [p]
        for names_of_group in SHARED_INPUT:
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
    layers = getattr(getattr(model, "model", None), "layers", None)
    final_norm, lm_head = getattr(getattr(model, "model", None), "norm", None), _bare(getattr(model, "lm_head", None))
    if not layers or final_norm is None or lm_head is None:
        return []
    key_of = {spec.weights[0]: key for key, (spec, _) in enumerate(groups) if not spec.mlp_down}
    mlps = {id(mlp) for mlp in gated_mlps(model, names).values()}
    tails = []
    for index, layer in enumerate(layers):
        last = index == len(layers) - 1
        attention, post_norm = getattr(layer, "self_attn", None), getattr(layer, "post_attention_layernorm", None)
        next_norm = final_norm if last else getattr(layers[index + 1], "input_layernorm", None)
        o_proj = _bare(getattr(attention, "o_proj", None))
        gate = _bare(getattr(getattr(layer, "mlp", None), "gate_proj", None))
        if o_proj is None or o_proj.bias is not None or gate is None or id(layer.mlp) not in mlps:
            return []
        norms = [getattr(norm, "weight", None) for norm in (post_norm, next_norm)]
        eps = {getattr(norm, "variance_epsilon", None) for norm in (post_norm, next_norm)}
        if any(w is None or w.data_ptr() not in names for w in norms) or len(eps) != 1 or None in eps:
            return []
        following = lm_head if last else _bare(getattr(layers[index + 1].self_attn, "q_proj", None))
        key = None if following is None else key_of.get(names.get(following.weight.data_ptr(), ""))
        if key is None or (not last and len(groups[key][1]) != 3):
            return []
        mlp = layer.mlp
        spec = groups[key][0]
        tails.append((bp.GroupSpec(weights=spec.weights, biases=spec.biases, tail=bp.LayerTail(
            o_proj=names[o_proj.weight.data_ptr()], post_norm=names[norms[0].data_ptr()],
            gate=names[_bare(mlp.gate_proj).weight.data_ptr()], up=names[_bare(mlp.up_proj).weight.data_ptr()],
            down=names[_bare(mlp.down_proj).weight.data_ptr()], next_norm=names[norms[1].data_ptr()],
            eps=float(eps.pop()))), key))
    return tails


def install(model: nn.Module, tensors: dict[str, torch.Tensor], path: str,
            max_rows: int = DEFAULT_MAX_ROWS) -> BasePassClient:
    """Route `model`'s backbone linear layers through the executor at `path` (`layer_groups`, then `layer_tails`);
    raises BasePassUnavailable if it cannot be reached or refuses."""
    groups = layer_groups(model, tensors)
    tails = layer_tails(model, tensors, groups)
    widths = [(layers[0].in_features, [layers[-1].out_features] if spec.mlp_down else
               [layer.out_features for layer in layers]) for spec, layers in groups]
    for _, key in tails:
        hidden = groups[key][1][0].in_features
        widths.append((3 * hidden, [hidden, hidden, *widths[key][1]]))
    specs = [spec for spec, _ in groups] + [spec for spec, _ in tails]
    client = BasePassClient(path, specs, widths, groups[0][1][0].weight.dtype, max_rows)
    mlp_of_gate = {id(_bare(mlp.gate_proj)): mlp
                   for mlp in gated_mlps(model, {t.data_ptr(): name for name, t in tensors.items()}).values()}
    shared_of: dict[int, list] = {}
    for key, (spec, layers) in enumerate(groups):
        if spec.mlp_down:
            mlp = mlp_of_gate[id(layers[0])]
            mlp.forward = RemoteMLP(mlp, client, key)
            continue
        shared: list = [None, None]
        shared_of[key] = shared
        for index, layer in enumerate(layers):
            layer.forward = RemoteForward(layer, client, key, index, len(layers), shared)
    if tails:
        qkv = [[None, None]] + [shared_of[key] for _, key in tails[:-1]]  # layer 0's is never primed
        client.tails = LayerTails(client, list(range(len(groups), len(groups) + len(tails))), qkv)
    model._lorafaas_base_pass = client
    return client


def uninstall(model: nn.Module) -> None:
    """Every linear layer computes here again (before the backbone is unbound)."""
    model.__dict__.pop("_lorafaas_base_pass", None)
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), (RemoteForward, RemoteMLP)):
            del module.forward
