"""The step gate's bytes, shared by the worker (`lorafaas.function_runtime.step_gate`, which describes the protocol)
and the node agent that serves it (`lorafaas.platform.compute_gate`). Kept apart from the worker's side so that the
agent's process does not import torch to learn eight constants."""

from __future__ import annotations

WANT, DONE, NEXT, MEMBER, LEAVE = b"w", b"d", b"n", b"m", b"l"
# DONE and NEXT of a step whose time says nothing of its mode's: it carried a prompt's prefill, or the shared pass
# told it ALONE (it computed its whole pass itself); the gate does not measure it (`CoreGrants.done`)
DONE_UNSAMPLED, NEXT_UNSAMPLED = b"D", b"N"
SHARED = 0x80  # the flag on a grant's byte
