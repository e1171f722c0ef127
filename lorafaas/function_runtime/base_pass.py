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
products (`RemoteForward`, primed) and add their LoRA deltas as before. The engine hands the client `install`
returned to each decode step (`GenerationEngine.base_pass`): nothing on the model itself names it.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import socket

import msgspec
import torch
from torch import nn

from lorafaas.cuda_ipc.layout import dtype_name
from lorafaas.models.base_pass_groups import bare_linear, gated_mlps, layer_groups, layer_tails
from lorafaas.models.cpu_linear import is_bare_linear
from lorafaas.models.families import llama
from lorafaas.models.lora import LoraLinear, adapter_version
from lorafaas.protocols import base_pass as bp
from lorafaas.protocols.base_pass import BasePassUnavailable
from lorafaas.protocols.shared_mapping import map_shared
from lorafaas.wire import FRAME_HEADER_BYTES, encode_frame, frame_length

log = logging.getLogger(__name__)
_welcome_decoder = msgspec.msgpack.Decoder(bp.BasePassWelcome)

DEFAULT_MAX_ROWS = 256
EXACT_IN_FLOAT32 = {torch.float32, torch.bfloat16, torch.float16}  # an o_proj delta of these goes to a tail as float32
CALL_TIMEOUT_S = 30.0




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
        self._fd: int | None = os.memfd_create("lorafaas-base-pass", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, size)
        # the executor maps it: never shorter, nor longer
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        # keeps no descriptor: none stays in /proc/<worker>/fd
        self._buffer: ctypes.Array | None = map_shared(self._fd, size)
        self._flat: torch.Tensor | None = torch.frombuffer(self._buffer, dtype=dtype)
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
        finally:  # handed over (or not): the mapping keeps the buffer, no descriptor of it stays in /proc/PID/fd
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
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
            flat = self._flat
            if flat is None:
                raise OSError("the base pass client is closed")  # as its closed socket would say
            for start in range(0, max(rows.shape[0], 1), self.max_rows):
                chunk = rows[start:start + self.max_rows]
                n = chunk.shape[0]
                flat[: n * width].view(n, width).copy_(chunk)
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
                    results[i].append(flat[offset:offset + n * out].view(n, out).clone())
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
        self._flat = self._buffer = None  # unmapped once the last view of it goes (`map_shared`)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

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
        if all(is_bare_linear(layer) for layer in llama.mlp_layers(mlp)):
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
        """Whether this step's layers are the ones the tails compute: o_proj bare or with a LoRA whose delta is
        float32 exactly (it is sent as float32), MLPs and LM head bare, q/k/v through the pass. Checked again only
        when an adapter was attached or detached since (it takes about 0.5 ms on SmolLM2, every decode step)."""
        version = adapter_version(model)
        if self._checked is None or self._checked[0] != version:
            self._checked = (version, self._usable(model))
        return self._checked[1]

    def _usable(self, model: nn.Module) -> bool:
        for layer in llama.decoder_layers(model):  # a Llama's (layer_tails found its layer tails)
            o_proj, mlp = llama.o_proj(layer), llama.mlp(layer)
            if isinstance(o_proj, LoraLinear):
                if (o_proj.lora_a is not None and o_proj.lora_b is not None
                        and not {o_proj.lora_a.dtype, o_proj.lora_b.dtype} <= EXACT_IN_FLOAT32):
                    return False
                o_proj = o_proj.base
            if not is_bare_linear(o_proj) or not isinstance(mlp.__dict__.get("forward"), RemoteMLP) \
                    or not all(is_bare_linear(projection) for projection in llama.mlp_layers(mlp)):
                return False
            if not all(isinstance(getattr(bare_linear(projection), "__dict__", {}).get("forward"), RemoteForward)
                       for projection in llama.qkv_layers(layer)):
                return False
        return is_bare_linear(llama.lm_head(model))

    def call(self, index: int, o_proj: nn.Module, attended: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
        """Decoder layer `index`'s tail: (residual stream, next normed input) with the next q/k/v products primed,
        or after the last layer the logits; None when this pass is not fused (then compute here)."""
        if not self.client.fused:
            return None
        delta = o_proj.delta(attended).float() if isinstance(o_proj, LoraLinear) and o_proj.lora_a is not None \
            else torch.zeros(hidden.shape, dtype=torch.float32)
        # the float32 delta's bytes as the buffer's elements (two a value in bf16): `bp.tail_in_width`
        outputs = self.client.call(self.keys[index], torch.cat([attended, hidden, delta.view(hidden.dtype)], dim=-1))
        if outputs is None:
            return None
        if index == len(self.keys) - 1:
            return outputs[2]
        self.qkv[index + 1][:] = [outputs[1], outputs[2:]]
        return outputs[0], outputs[1]

    def clear(self) -> None:
        for shared in self.qkv:
            shared[:] = [None, None]


def fused_pass(model: nn.Module, client: BasePassClient | None) -> LayerTails | None:
    """The layer tails of `model`'s decode step about to start (its first call asks for them), `client` the model's
    pass (`install`; None outside one), or None: this step goes group by group (or is computed here)."""
    if client is None:
        return None
    tails = client.tails
    if tails is None or client.broken or client.local or client.alone or not tails.usable(model):
        return None
    client.arm_fused()
    return tails


def install(model: nn.Module, tensors: dict[str, torch.Tensor], path: str,
            max_rows: int = DEFAULT_MAX_ROWS) -> BasePassClient:
    """Route `model`'s backbone linear layers through the executor at `path` (`layer_groups`, then `layer_tails`);
    raises BasePassUnavailable if it cannot be reached or refuses."""
    groups = layer_groups(model, tensors)
    tails = layer_tails(model, tensors, groups)
    widths = [(layers[0].in_features, [layers[-1].out_features] if spec.mlp_down else
               [layer.out_features for layer in layers]) for spec, layers in groups]
    dtype = groups[0][1][0].weight.dtype
    for spec, key in tails:
        hidden = groups[key][1][0].in_features
        attended = tensors[spec.tail.o_proj].shape[1] if spec.tail is not None else hidden
        widths.append((bp.tail_in_width(attended, hidden, dtype_name(dtype)),
                       [hidden, hidden, *widths[key][1]]))
    specs = [spec for spec, _ in groups] + [spec for spec, _ in tails]
    client = BasePassClient(path, specs, widths, dtype, max_rows)
    mlp_of_gate = {id(bare_linear(llama.mlp_layers(mlp)[0])): mlp
                   for mlp in gated_mlps(model, {t.data_ptr(): name for name, t in tensors.items()}).values()}
    shared_of: dict[int, list] = {}
    for key, (spec, layers) in enumerate(groups):
        if spec.mlp_down:
            mlp = mlp_of_gate[id(layers[0])]
            mlp.__dict__["forward"] = RemoteMLP(mlp, client, key)
            continue
        shared: list = [None, None]
        shared_of[key] = shared
        for index, layer in enumerate(layers):
            layer.__dict__["forward"] = RemoteForward(layer, client, key, index, len(layers), shared)
    if tails:
        qkv = [[None, None]] + [shared_of[key] for _, key in tails[:-1]]  # layer 0's is never primed
        client.tails = LayerTails(client, list(range(len(groups), len(groups) + len(tails))), qkv)
    return client


def uninstall(model: nn.Module) -> None:
    """Every linear layer computes here again (before the backbone is unbound)."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), (RemoteForward, RemoteMLP)):
            del module.forward
