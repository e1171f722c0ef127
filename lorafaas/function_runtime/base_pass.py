"""A function instance's side of the shared base pass (`lorafaas.protocols.base_pass`): the backbone's linear layers
computed by the device's executor together with other functions' rows.

`install(model, tensors, path)` puts a `RemoteForward` in front of every backbone linear layer the model binds from
the segment (inside `LoraLinear`, whose LoRA delta stays here, or bare, like an untargeted `lm_head`). A forward pass
then sends each group's input (q, k and v share one) to the executor and reads the outputs back. A gated MLP goes
whole (`RemoteMLP`: gate, up, SiLU and down in one call) unless the adapter wraps one of its layers; then the MLP is
computed here and its call carries 0 rows. When the executor answers ALONE at a pass's start, or cannot be reached,
the pass runs here as before, from this process's own read-only mapping of the same weights, so the results are
those of the same linear layers.
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
# norms computed as LlamaRMSNorm does, so the executor can compute a gated MLP's next layer's input with it
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
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
        self.num_calls = 0
        self.num_skips = 0  # gated-MLP calls with 0 rows: this member computed the MLP itself
        self.num_prefetched = 0  # q/k/v taken from the call of the layer before (`PrefetchedForward`)
        self.num_prefetch_misses = 0  # computed here: the normed input was not the executor's
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
        try:
            for start in range(0, max(rows.shape[0], 1), self.max_rows):
                chunk = rows[start:start + self.max_rows]
                n = chunk.shape[0]
                self._flat[: n * width].view(n, width).copy_(chunk)
                flags = bp.CONTINUATION if start else 0
                self._sock.sendall(bp.HEADER.pack(key, n, flags))
                reply = self._sock.recv(1)
                if reply == bp.ALONE and key == 0 and not start:
                    self.alone = True
                    self.num_alone_passes += 1
                    return self._pass_over(key, None)
                if reply != bp.DONE:
                    raise ConnectionError(f"the executor answered {reply!r}")
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

    def begin_step(self, shared: bool) -> None:
        """Before each engine step: whether its backbone products go to the executor (else computed here)."""
        self.local = not shared
        if self.local and self._awaited:  # no round should wait for this member's pass start
            self._end(again=False)

    def end_step(self, again: bool) -> None:
        """After each engine step: whether this instance has another step to run."""
        self.alone = False
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
        if key == len(self.groups) - 1:  # the pass's last group: the next call starts a pass
            self.alone = False
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
        if self.index == 0:
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
        return nn.Linear.forward(self.layer, x)


class RemoteMLP:
    """The forward of a gated MLP the executor computes whole (`GroupSpec.mlp_down`). While an adapter wraps one of
    its layers, the MLP is computed here with the adapter's deltas and the call goes with 0 rows (its place in the
    round); computed here too when the step or pass is (`BasePassClient.call` answers None).

    With `stream` and `prefetch` (the group has `next_norm`) the call also sends the residual stream the decoder layer
    passed to its post-attention norm (`CapturedInput`), and puts the next layer's normed input and q/k/v outputs in
    `prefetch` for its `PrefetchedForward`s."""

    def __init__(self, mlp: nn.Module, client: BasePassClient, key: int, stream: list | None = None,
                 prefetch: list | None = None) -> None:
        self.mlp = mlp
        self.client = client
        self.key = key
        self.stream = stream
        self.prefetch = prefetch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        stream = None
        if self.stream is not None:
            stream, self.stream[0] = self.stream[0], None
        if all(type(getattr(mlp, name)) is nn.Linear for name in MLP_LAYERS):
            if self.stream is None:
                outputs = self.client.call(self.key, x)
            elif stream is not None and stream.shape == x.shape:
                outputs = self.client.call(self.key, torch.cat([x, stream], -1))
            else:  # no residual stream seen (not a decoder layer's call): computed here, in step with the round
                self.client.skip(self.key)
                outputs = None
            if outputs is not None:
                if self.prefetch is not None:
                    self.prefetch[:] = [outputs[1], outputs[2:]]
                return outputs[0]
        else:
            self.client.skip(self.key)
        return type(mlp).forward(mlp, x)


class CapturedInput:
    """The forward of a decoder layer's post-attention norm: keeps its input (the residual stream) for the layer's
    `RemoteMLP`, which takes it."""

    def __init__(self, norm: nn.Module, slot: list) -> None:
        self.norm = norm
        self.slot = slot

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.slot[0] = hidden
        return type(self.norm).forward(self.norm, hidden)


class PrefetchedForward:
    """The forward of a q, k or v layer whose product came with the previous layer's MLP call: used only when this
    layer's input equals, bit for bit, the normed input the executor computed; else computed here."""

    def __init__(self, layer: nn.Linear, client: BasePassClient, index: int, size: int, prefetch: list) -> None:
        self.layer = layer
        self.client = client
        self.index = index
        self.size = size
        self.prefetch = prefetch  # [normed input, outputs] until the group's last layer took its output

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        given, outputs = self.prefetch
        if self.index == 0:
            if outputs is not None and given.shape == x.shape and torch.equal(given, x):
                self.prefetch[0] = x  # k and v are given the same tensor
                self.client.num_prefetched += 1
                return outputs[0]
            self.prefetch[:] = [None, None]
            self.client.num_prefetch_misses += outputs is not None
            return nn.Linear.forward(self.layer, x)
        if self.index == self.size - 1:
            self.prefetch[:] = [None, None]
        if outputs is None or given is not x:
            return nn.Linear.forward(self.layer, x)
        return outputs[self.index]


def _bare(layer: nn.Module | None) -> nn.Linear | None:
    """The backbone's linear layer in `layer` (itself, or the `base` of a LoRA wrapper), or None."""
    base = getattr(layer, "base", layer)
    return base if type(base) is nn.Linear else None


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


def _next_layer(model: nn.Module, mlp_prefix: str, found: dict[str, nn.Linear], names: dict[int, str]
                ) -> tuple[str, nn.Module, nn.Module] | None:
    """For the gated MLP at `mlp_prefix` ("model.layers.3.mlp."): the next decoder layer's prefix, this layer's
    post-attention norm and the next one's input norm, if the executor can compute that layer's q/k/v with it."""
    layer_path = mlp_prefix.removesuffix("mlp.").rstrip(".")
    parent, _, index = layer_path.rpartition(".")
    if not index.isdigit():
        return None
    next_prefix = f"{parent}.{int(index) + 1}."
    try:
        layer, following = model.get_submodule(layer_path), model.get_submodule(next_prefix[:-1])
    except AttributeError:
        return None
    post, norm = getattr(layer, "post_attention_layernorm", None), getattr(following, "input_layernorm", None)
    if type(post).__name__ not in RMS_NORMS or type(norm).__name__ not in RMS_NORMS \
            or norm.weight.data_ptr() not in names:
        return None
    attention = [found.get(f"{next_prefix}{name}") for name in SHARED_INPUT[0]]
    if any(layer is None or layer.bias is not None for layer in attention):
        return None
    return next_prefix, post, norm


def _plan(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[tuple[bp.GroupSpec, list[nn.Linear], tuple]]:
    """`layer_groups`, each with what `install` needs beyond its layers: for a gated MLP (its module, and with the
    next layer's q/k/v: the post-attention norm)."""
    names = {t.data_ptr(): name for name, t in tensors.items()}
    found: dict[str, nn.Linear] = {}  # path -> layer, in module order (LoRA wrappers looked through)
    for path_of, module in model.named_modules():
        if type(module) is nn.Linear and module.weight.data_ptr() in names:
            found[path_of.removesuffix(".base")] = module
    if not found:
        raise BasePassUnavailable("the model has no linear layer bound to the backbone's segment")
    mlps = gated_mlps(model, names)
    groups: list[tuple[bp.GroupSpec, list[nn.Linear], tuple]] = []
    grouped: set[str] = set()
    for p in found:
        if p in grouped:
            continue
        if p in mlps:
            prefix = p.removesuffix("gate_proj")
            layers = [found[prefix + name] for name in MLP_LAYERS]
            grouped.update(prefix + name for name in MLP_LAYERS)
            gate, up, down = (names[layer.weight.data_ptr()] for layer in layers)
            spec = bp.GroupSpec(weights=(gate, up), biases=(None, None), mlp_down=down)
            following = _next_layer(model, prefix, found, names)
            if following is None:
                groups.append((spec, layers, (mlps[p], None)))
                continue
            next_prefix, post, norm = following
            attention = [next_prefix + name for name in SHARED_INPUT[0]]
            grouped.update(attention)
            layers += [found[path] for path in attention]
            spec = msgspec.structs.replace(spec, next_norm=names[norm.weight.data_ptr()], norm_eps=float(
                norm.variance_epsilon), next_weights=tuple(names[layer.weight.data_ptr()] for layer in layers[3:]))
            groups.append((spec, layers, (mlps[p], post)))
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
                                    biases=biases), layers, ()))
    return groups


def layer_groups(model: nn.Module, tensors: dict[str, torch.Tensor]) -> list[tuple[bp.GroupSpec, list[nn.Linear]]]:
    """The groups of `model`'s backbone linear layers (those whose weights are `tensors`, the attached segment's), in
    module order, each with its layers (a gated MLP's: gate, up, down, and the next layer's q, k, v when the call
    computes them too); raises BasePassUnavailable if there are none."""
    return [(spec, layers) for spec, layers, _ in _plan(model, tensors)]


def _widths(spec: bp.GroupSpec, layers: list[nn.Linear]) -> tuple[int, list[int]]:
    """(input width, output widths) of a group's call (protocol: a gated MLP's, with or without the next layer)."""
    hidden = layers[0].in_features
    if not spec.mlp_down:
        return hidden, [layer.out_features for layer in layers]
    if not spec.next_norm:
        return hidden, [hidden]
    return 2 * hidden, [hidden, hidden, *(layer.out_features for layer in layers[3:])]


def install(model: nn.Module, tensors: dict[str, torch.Tensor], path: str,
            max_rows: int = DEFAULT_MAX_ROWS) -> BasePassClient:
    """Route `model`'s backbone linear layers through the executor at `path` (`layer_groups`); raises
    BasePassUnavailable if it cannot be reached or refuses."""
    groups = _plan(model, tensors)
    widths = [_widths(spec, layers) for spec, layers, _ in groups]
    client = BasePassClient(path, [spec for spec, _, _ in groups], widths, groups[0][1][0].weight.dtype, max_rows)
    for key, (spec, layers, extra) in enumerate(groups):
        if spec.mlp_down:
            mlp, post = extra
            if post is None:
                mlp.forward = RemoteMLP(mlp, client, key)
                continue
            stream, prefetch = [None], [None, None]
            post.forward = CapturedInput(post, stream)
            mlp.forward = RemoteMLP(mlp, client, key, stream, prefetch)
            for index, layer in enumerate(layers[3:]):
                layer.forward = PrefetchedForward(layer, client, index, len(layers) - 3, prefetch)
            continue
        shared: list = [None, None]
        for index, layer in enumerate(layers):
            layer.forward = RemoteForward(layer, client, key, index, len(layers), shared)
    return client


def uninstall(model: nn.Module) -> None:
    """Every linear layer computes here again (before the backbone is unbound)."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), (RemoteForward, RemoteMLP, CapturedInput, PrefetchedForward)):
            del module.forward
