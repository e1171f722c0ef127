"""The LoRA server's protocol: typed messages in length-prefixed msgpack frames (`lorafaas.wire`), one per event.

A connection opens with `Hello`; the server answers `Welcome` (its MoE layout) or an `ErrorReply` and closes. Then:

    AttachBuffer(size) + memfd      -> BufferAttached      Unix socket only: the client's duplex buffer, a memfd
                                                           sealed against shrinking, sent with the frame (SCM_RIGHTS)
    RegisterAdapter(id, dir)        -> AdapterRegistered   checked against the server's backbone, not loaded yet; on
             [+ directory fd]                              the Unix socket the frame carries a descriptor of the
                                                           adapter's directory, the only way the server reads it
    LoraCall(seq, adapter, layer,   -> LoraResult          the deltas of the routed rows of one MoE projection
             projection, rows...)
    Status()                        -> ServerStatus
    Shutdown(token)                 -> ShuttingDown        the token the server printed when it started

Adapter ids are the connection's own: a call names an id this connection registered, never another's.

Tensors never travel inside a message. A call's rows and result live either in the client's shared-memory buffer
(`ShmPayload`: an offset; the frame is the notification) or, over TCP between nodes, as raw bytes right after the
frame (`InlinePayload`: their count). The messages are the same on both transports.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 2

Projection = Literal["gate_up_proj", "down_proj"]
DType = Literal["float32", "float16", "bfloat16"]


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class ShmPayload(msgspec.Struct, frozen=True, kw_only=True, tag="shm"):
    offset: int  # bytes into the client's buffer


class InlinePayload(msgspec.Struct, frozen=True, kw_only=True, tag="inline"):
    nbytes: int  # raw bytes following the frame on the stream


Payload = ShmPayload | InlinePayload


# Requests
class Hello(_Message, frozen=True, tag="hello"):
    protocol_version: int
    client: str = ""  # for logs: the function instance


class AttachBuffer(_Message, frozen=True, tag="attach_buffer"):
    size: int  # bytes of the memfd that comes with the frame; the server maps it read-write and closes its descriptor


class RegisterAdapter(_Message, frozen=True, tag="register_adapter"):
    adapter_id: str
    adapter_dir: str  # Unix socket: for messages only (the directory's descriptor comes with the frame); TCP: a
    # path the server reads (the same node, or a shared adapter store)


class LoraCall(_Message, frozen=True, tag="lora_call"):
    seq: int
    adapter_id: str
    layer: int
    projection: Projection
    dtype: DType
    expert_counts: tuple[int, ...]  # rows are sorted by expert: expert_counts[e] rows for expert e
    rows: Payload  # [sum(expert_counts), in_features]
    result_offset: int | None = None  # shm: where the server writes the [rows, out_features] deltas


class Status(_Message, frozen=True, tag="status"):
    pass


class Shutdown(_Message, frozen=True, tag="shutdown"):
    token: str = ""  # the server's shutdown token (its ready line): a function does not have it


Request = Hello | AttachBuffer | RegisterAdapter | LoraCall | Status | Shutdown


# Responses
class Welcome(_Message, frozen=True, tag="welcome"):
    protocol_version: int
    server_pid: int
    device: str
    dtype: DType
    num_experts: int
    hidden_size: int
    intermediate_size: int
    layers: tuple[int, ...]  # the MoE layer numbers


class BufferAttached(_Message, frozen=True, tag="buffer_attached"):
    size: int


class AdapterRegistered(_Message, frozen=True, tag="adapter_registered"):
    adapter_id: str
    rank: int
    expert_bytes: int


class LoraResult(_Message, frozen=True, tag="lora_result"):
    seq: int
    num_rows: int
    out_features: int
    result: Payload


class CacheStatus(msgspec.Struct, frozen=True, kw_only=True):
    capacity: int  # adapters
    resident: dict[str, tuple[int, ...]]  # adapter id -> its layers loaded
    resident_bytes: int
    num_hits: int  # calls whose adapter was resident
    num_misses: int  # calls that admitted their adapter
    num_layer_loads: int
    num_evictions: int


class ServerStatus(_Message, frozen=True, tag="server_status"):
    server_pid: int
    device: str
    uptime_s: float
    num_connections: int
    num_adapters: int  # registered
    num_calls: int
    num_batches: int
    max_calls_per_batch: int  # calls (of any instances and adapters) grouped into one batch
    num_groups: int  # (adapter, layer, projection, expert) low-rank products run
    compute_s: float  # time the compute thread spent on batches
    cache: CacheStatus
    num_deferred: int = 0  # calls that waited for their client's budget
    num_refused: int = 0  # connections refused or hung up on (a bad buffer, a stall, a malformed stream)


class ShuttingDown(_Message, frozen=True, tag="shutting_down"):
    pass


class ErrorReply(_Message, frozen=True, tag="error"):
    code: str  # a LorafaasError code
    message: str
    seq: int | None = None


Response = Welcome | BufferAttached | AdapterRegistered | LoraResult | ServerStatus | ShuttingDown | ErrorReply

request_decoder = msgspec.msgpack.Decoder(Request)
response_decoder = msgspec.msgpack.Decoder(Response)
