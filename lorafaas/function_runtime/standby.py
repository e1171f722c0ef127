"""A pool process: forked from the zygote for no function, made ready to serve one, then given exactly one.

Before its assignment it attaches its backbone's sealed segment through the daemon (a lease under STANDBY_FUNCTION,
a name no function can have), loads nothing of any function, and runs one forward pass on a dummy prompt without an
adapter, so that the first prefill of the process (kernel primitives created, thread pools started, the mapped
backbone's pages faulted in) is paid off the request path. Then it listens on its own socket for one `Assign`:

    Hello, Assign(spec, log_path) -> Assigned(pid)    then it is `spec`'s worker (worker.py) until it exits

A process serves one function for its whole life: after the assignment it closes the pool socket, so nothing can
assign it again, and the launcher never hands it out a second time. What today's worker applies at spawn is applied
at the assignment: its logs go to the function's log file, its step gate, shared base pass and batch size are the
spec's. It stays undumpable from the fork (forbid_dumping), and dies with the zygote like any forked worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from pathlib import Path

import msgspec

from lorafaas.errors import ProtocolError
from lorafaas.function_runtime import messages as m
from lorafaas.function_runtime.instance import FunctionInstance
from lorafaas.protocols.process_guard import forbid_dumping
from lorafaas.wire import call_unix, encode_frame, error_class, recv_message

log = logging.getLogger(__name__)
STANDBY_FUNCTION = "(standby)"  # the lease's function while it serves none: not a valid function name
request_decoder = msgspec.msgpack.Decoder(m.StandbyRequest)
reply_decoder = msgspec.msgpack.Decoder(m.StandbyReply)
# what must match between a pool process and the spec it is given: what it attached and warmed up with
SAME_FIELDS = ("model_dir", "daemon_socket", "device", "num_threads")


def mismatch(standby: m.WorkerSpec, spec: m.WorkerSpec) -> str | None:
    """Why `spec` cannot be served by a pool process started with `standby` (None: it can)."""
    for name in SAME_FIELDS:
        if getattr(standby, name) != getattr(spec, name):
            return f"{name} is {getattr(spec, name)!r}; this pool process has {getattr(standby, name)!r}"
    return None


def run_standby(spec: m.WorkerSpec, tokenizer=None) -> int:
    forbid_dumping()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [standby {os.getpid()}] %(name)s: %(message)s")
    started = time.perf_counter()
    instance = FunctionInstance(spec, tokenizer)
    instance.load("libraries")
    instance.load("backbone")
    instance.warm_up_plain()
    ready_s = time.perf_counter() - started
    log.info("ready in %.0f ms (backbone attached, warm-up run); waiting for a function", ready_s * 1e3)
    assignment = _wait_for_assignment(spec, ready_s)
    _become_function_worker(assignment)
    instance.assign(assignment.spec)
    from lorafaas.function_runtime.worker import WorkerServer

    asyncio.run(WorkerServer(assignment.spec, instance=instance).serve())
    return 0


def _wait_for_assignment(spec: m.WorkerSpec, ready_s: float) -> m.Assign:
    """Serve the pool socket until one valid assignment arrives; then the socket is closed and removed for good."""
    path = Path(spec.socket_path)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    path.chmod(0o600)
    listener.listen(4)
    try:
        while True:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(10)
                try:
                    hello = recv_message(conn, request_decoder)
                    request = recv_message(conn, request_decoder)
                except ConnectionError:  # a probe that it listens (the launcher's), or a client gone
                    continue
                except (OSError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                    log.warning("dropped a malformed request: %s", exc)
                    continue
                why = None
                if not isinstance(hello, m.Hello) or hello.version != m.PROTOCOL_VERSION:
                    why = f"expected hello with protocol version {m.PROTOCOL_VERSION}"
                elif not isinstance(request, m.Assign):
                    why = f"expected an assignment, got {type(request).__name__}"
                else:
                    why = mismatch(spec, request.spec)
                if why is not None or not isinstance(request, m.Assign):
                    conn.sendall(encode_frame(m.ErrorReply(request_id=None, code="invalid_input", message=str(why))))
                    continue
                conn.sendall(encode_frame(m.Assigned(pid=os.getpid(), seconds=ready_s)))
                return request
    finally:
        listener.close()
        path.unlink(missing_ok=True)


def _become_function_worker(assignment: m.Assign) -> None:
    """What a worker forked for this function gets at spawn: its log file and its log lines naming it."""
    fd = os.open(assignment.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    spec = assignment.spec
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format=f"%(asctime)s %(levelname)s [{spec.function}/{spec.instance_id}] %(name)s: %(message)s")


def assign(socket_path: Path, spec: m.WorkerSpec, log_path: Path, timeout_s: float = 10.0) -> m.Assigned:
    """Give the pool process listening at `socket_path` its function (the launcher's side)."""
    reply = call_unix(socket_path, [m.Hello(version=m.PROTOCOL_VERSION), m.Assign(spec=spec, log_path=str(log_path))],
                      reply_decoder, "pool process", timeout_s)
    if isinstance(reply, m.ErrorReply):
        raise error_class(reply.code)(reply.message)
    if not isinstance(reply, m.Assigned):
        raise ProtocolError(f"the pool process answered {reply!r} to an assignment")
    return reply
