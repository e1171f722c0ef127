"""The shared base pass: the rows of several functions through the backbone's linear layers in one batched pass.

Each function instance computes its own forward pass (attention, KV cache, its LoRA delta, sampling). Only the
backbone's shared, read-only linear layers are handed to the device's base-pass executor, which computes the rows of
every function at the same point of its pass in one matrix product: N hot functions then read the weights once per
step instead of N times (docs/performance.md, "The shared base pass").

A member (one function instance) talks to the executor over its own Unix stream socket and its own buffer: a memfd the
member creates and hands over once (SCM_RIGHTS), shared with the executor and with no other function.

    hello     member -> executor   a frame (`BasePassHello`: its layer groups, rows, dtype) with the buffer's fd
    welcome   executor -> member   a frame (`BasePassWelcome`): accepted, or refused and why
    CALL      member -> executor   the header (key, rows, flags) once X [rows, in] is at offset 0 of the buffer
              executor -> member   DONE: the group's outputs are in the output region, each [rows, out_i], one
                                   after another; or ALONE (only for a pass's first group): no other function is at
                                   a pass's start, compute this pass locally
    END       member -> executor   the header (END_KEY, 0, again) after each engine step: again says whether the
                                   member has another step to run (the executor waits for it at the next pass start)

Flags of a CALL: CONTINUATION, a further chunk of the group just called (rows beyond `max_rows`), served at once.

A gated MLP (`GroupSpec.mlp_down`: gate and up, SiLU, down) is one group, so a decoder layer costs three calls, not
four. A member whose adapter wraps one of its layers computes that MLP itself: it calls the group with 0 rows, which
keeps its place in the round (a member that did not call would hold the round up to the deadline), and gets DONE.

Layer tails (`GroupSpec.tail`, after every other group): one call a decoder layer in a decode step. A tail takes a
layer's attention output, the residual stream and the adapter's o_proj delta, and gives the residual stream after the
layer's o_proj and MLP, the next layer's normed input and the group's products of it (the next layer's q, k and v, or
after the last layer the LM head's logits). A pass whose first call carries FUSED goes key 0, then the tails in order;
any other pass goes through the groups before the first tail in order. So a decode step over 30 layers costs 31 calls
instead of 91; the member keeps attention, KV cache, its LoRA deltas and sampling.
"""

from __future__ import annotations

import struct

import msgspec

HEADER = struct.Struct("<iii")  # key (the group's index, or END_KEY), rows, flags
DONE, ALONE = b"d", b"a"
END_KEY = -1
CONTINUATION = 1  # CALL flag: another chunk of the group just called
FUSED = 2  # CALL flag of a pass's first call: this pass goes through the layer tails
AGAIN = 1  # END flag: the member has another step to run

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_ROWS = 4096
MAX_BUFFER_BYTES = 1 << 30


class LayerTail(msgspec.Struct, frozen=True):
    """The segment's names of a decoder layer's o_proj, post-attention norm, gated MLP (gate, up, down; SiLU, no
    biases) and of the norm before the next products (the next layer's input norm, or the final norm)."""

    o_proj: str
    post_norm: str
    gate: str
    up: str
    down: str
    next_norm: str
    eps: float


class GroupSpec(msgspec.Struct, frozen=True):
    """Linear layers that take the same input (e.g. q, k and v): the segment's names of their weights ([out, in],
    one `in`) and biases (None: no bias). With `mlp_down`, a gated MLP: weights are gate and up (no biases), and
    the group's one output is down(silu(gate(x)) * up(x)), `mlp_down` naming down's weight.

    With `tail`, a layer tail: X is [attention output (o_proj's in), residual (hidden), o_proj's LoRA delta
    (hidden values in float32, whatever the backbone's dtype: `tail_in_width`; zeros without one)]; with
    o = (o_proj(attention) + delta) in the backbone's dtype, h = residual + o, h = h + mlp(post_norm(h)),
    n = next_norm(h), the outputs are h, n and the weights' products of n, in that order."""

    weights: tuple[str, ...]
    biases: tuple[str | None, ...]
    mlp_down: str | None = None
    tail: LayerTail | None = None


class BasePassHello(msgspec.Struct, frozen=True, tag="hello"):
    groups: tuple[GroupSpec, ...]  # in the order a forward pass calls them
    max_rows: int  # rows per call; more are sent in chunks
    dtype: str  # of the weights and of X


class BasePassWelcome(msgspec.Struct, frozen=True, tag="welcome"):
    accepted: bool
    message: str = ""


class BasePassUnavailable(Exception):
    """The base pass cannot be joined (unreachable, refused, or the model has no groups): compute here."""


def delta_elements(dtype: str) -> int:
    """Elements of a `dtype` buffer one float32 value of a layer tail's o_proj delta takes. The delta travels in
    float32 because an adapter is usually saved in float32: PEFT adds its float32 delta to a bf16 backbone's product
    in float32 and rounds the sum once, and so does the tail (a bf16 adapter's delta converts to float32 exactly)."""
    return ELEMENT_BYTES["float32"] // ELEMENT_BYTES[dtype]


def tail_in_width(attended: int, hidden: int, dtype: str) -> int:
    """X's width of a layer tail in `dtype` elements: the attention's output, the residual and the float32 delta."""
    return attended + hidden + hidden * delta_elements(dtype)


def buffer_layout(max_rows: int, max_in: int, max_out: int, dtype: str) -> tuple[int, int]:
    """(offset of the output region, total bytes) of a member's buffer: X [max_rows, max_in] at offset 0, then room
    for the outputs of any group, [max_rows, sum of its outs]."""
    element = ELEMENT_BYTES[dtype]
    output_offset = max_rows * max_in * element
    return output_offset, output_offset + max_rows * max_out * element
