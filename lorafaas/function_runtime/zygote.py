"""The pre-warmed library pool: a zygote process that imports the libraries once and forks function workers.

A forked worker skips the imports (the `libraries` artifact is pre-loaded) and shares the library pages with the
zygote copy-on-write. The zygote starts no threads (torch's thread pools start on the first operation, which happens
only in the children), so forking it is safe. It serves a one-request-per-connection protocol on a Unix socket:
`Spawn` -> `Spawned(pid)`, `SpawnStandby` -> `Spawned(pid)` (a pool process for no function yet: standby.py),
`Prepare` -> `Prepared`, `ZygoteStatusRequest` -> `ZygoteStatus`, `Shutdown`.

The pool also holds each backbone's tokenizer once it has been asked to (`Prepare`, or the first `Spawn` for that
backbone): host-side parts of the backbone artifact, shared with every worker it forks like the libraries.

A forked worker dies with the zygote (PR_SET_PDEATHSIG: SIGTERM, its graceful stop), so stopping the zygote, or the
next platform stopping a dead platform's zygote, leaves none of its workers behind.

    python -m lorafaas.function_runtime.zygote SOCKET_PATH
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec

from lorafaas.errors import InstanceUnavailable, ProtocolError
from lorafaas.function_runtime import messages as m
from lorafaas.protocols.priority import FUNCTION_NICENESS, child_env, take_data_plane_niceness
from lorafaas.protocols.process_guard import forbid_dumping
from lorafaas.protocols.socket_path import BoundPath
from lorafaas.wire import call_unix, encode_frame, error_class, recv_message

log = logging.getLogger(__name__)
request_decoder = msgspec.msgpack.Decoder(m.ZygoteRequest)
reply_decoder = msgspec.msgpack.Decoder(m.ZygoteReply)


class Zygote:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = Path(socket_path)
        self.children: set[int] = set()
        self.exit_codes: dict[int, int] = {}
        self.import_s = 0.0
        self.tokenizers: dict[str, object] = {}  # model_dir -> tokenizer, inherited by forked workers
        self._running = True

    def serve(self) -> None:
        from lorafaas.function_runtime.instance import import_libraries

        started = time.perf_counter()
        import_libraries()
        self.import_s = time.perf_counter() - started
        if threading.active_count() != 1:  # forking a process with threads would copy locks held by them
            raise RuntimeError(f"the zygote has {threading.active_count()} threads after imports; it must have one")
        self.socket_path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        bound = BoundPath(self.socket_path)  # mode 0600; removed at exit only while still this zygote's
        listener.listen(64)
        signal.signal(signal.SIGCHLD, lambda *_: self._reap())
        signal.signal(signal.SIGTERM, lambda *_: self._stop(listener))
        log.info(
            "zygote %d: libraries imported in %.2f s; listening on %s", os.getpid(), self.import_s, self.socket_path
        )
        try:
            while self._running:
                try:
                    conn, _ = listener.accept()
                except OSError:  # the listener was closed by SIGTERM
                    break
                with conn:
                    self._handle(conn, listener)
        finally:
            listener.close()
            bound.unlink()  # not a successor's, started on this home while this one stopped

    def _handle(self, conn: socket.socket, listener: socket.socket) -> None:
        conn.settimeout(10)
        try:
            hello = recv_message(conn, request_decoder)
            if not isinstance(hello, m.Hello) or hello.version != m.PROTOCOL_VERSION:
                conn.sendall(
                    encode_frame(
                        m.ErrorReply(
                            request_id=None,
                            code="protocol_error",
                            message=f"expected protocol version {m.PROTOCOL_VERSION}",
                        )
                    )
                )
                return
            request = recv_message(conn, request_decoder)
        except (OSError, ConnectionError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            log.warning("zygote: dropped a malformed request: %s", exc)
            return
        if isinstance(request, (m.Spawn, m.SpawnStandby)):
            self._prepare(request.spec.model_dir)
            pid = self._fork(request, conn, listener)
            conn.sendall(encode_frame(m.Spawned(pid=pid)))
        elif isinstance(request, m.Prepare):
            seconds = self._prepare(request.model_dir)
            conn.sendall(encode_frame(m.Prepared(model_dir=request.model_dir, seconds=seconds)))
        elif isinstance(request, m.ZygoteStatusRequest):
            self._reap()
            conn.sendall(
                encode_frame(
                    m.ZygoteStatus(
                        pid=os.getpid(),
                        children=tuple(sorted(self.children)),
                        exit_codes=dict(self.exit_codes),
                        import_s=self.import_s,
                        prepared=tuple(self.tokenizers),
                        frozen_objects=gc.get_freeze_count(),
                    )
                )
            )
        elif isinstance(request, m.Shutdown):
            self._stop(listener)

    def _fork(self, request: m.Spawn | m.SpawnStandby, conn: socket.socket, listener: socket.socket) -> int:
        zygote_pid = os.getpid()
        # Out of the collector's reach: a collection in the worker writes into every object it tracks, which would
        # copy each page of the inherited heap (libraries, tokenizers) into the worker's private memory.
        gc.freeze()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                conn.close()
                listener.close()
                _become_worker(request.log_path, zygote_pid)
                tokenizer = self.tokenizers.get(request.spec.model_dir)
                if isinstance(request, m.SpawnStandby):  # a pool process: a function comes later, once
                    from lorafaas.function_runtime.standby import run_standby

                    code = run_standby(request.spec, tokenizer)
                else:
                    from lorafaas.function_runtime.worker import run_worker

                    code = run_worker(request.spec, tokenizer)
            except BaseException:
                logging.getLogger("lorafaas.worker").exception("worker %d failed", os.getpid())
            finally:
                os._exit(code)
        self.children.add(pid)
        log.info("zygote: forked worker %d for %s/%s", pid, request.spec.function, request.spec.instance_id)
        return pid

    def _prepare(self, model_dir: str) -> float:
        """Load the backbone's tokenizer into the pool (once). Tokenizer loading starts no threads."""
        if model_dir in self.tokenizers:
            return 0.0
        from lorafaas.function_runtime.instance import load_tokenizer

        started = time.perf_counter()
        try:
            self.tokenizers[model_dir] = load_tokenizer(Path(model_dir))
        except (OSError, ValueError) as exc:  # the worker will load (and report) it itself
            log.warning("zygote: cannot preload the tokenizer of %s: %s", model_dir, exc)
            return 0.0
        return time.perf_counter() - started

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.exit_codes[pid] = os.waitstatus_to_exitcode(status)

    def _stop(self, listener: socket.socket) -> None:
        self._running = False
        listener.close()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _become_worker(log_path: str, zygote_pid: int) -> None:
    """In the forked child: its own session, SIGTERM when the zygote dies, default signals, stdout and stderr to the
    instance log. (The zygote is single-threaded, so "the parent thread exits" means the zygote exits.)"""
    os.setsid()
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != zygote_pid:  # the zygote died before the death signal was armed
        os._exit(1)
    forbid_dumping()  # inherited from the zygote already; said again where a worker becomes one
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.getLogger().handlers.clear()


# -- clients --------------------------------------------------------------------------------------------------------


def _call(socket_path: Path, request: msgspec.Struct, timeout_s: float = 30.0):
    decoder = None if isinstance(request, m.Shutdown) else reply_decoder  # the zygote exits without a reply
    reply = call_unix(socket_path, [m.Hello(version=m.PROTOCOL_VERSION), request], decoder, "zygote", timeout_s)
    if isinstance(reply, m.ErrorReply):
        raise error_class(reply.code)(reply.message)
    return reply


def spawn_worker(socket_path: Path, spec: m.WorkerSpec, log_path: Path) -> int:
    """Fork a worker from the zygote; returns its pid (it starts listening on spec.socket_path shortly after)."""
    reply = _call(socket_path, m.Spawn(spec=spec, log_path=str(log_path)))
    if not isinstance(reply, m.Spawned):
        raise ProtocolError(f"zygote answered {reply!r} to spawn")
    return reply.pid


def spawn_standby(socket_path: Path, spec: m.WorkerSpec, log_path: Path) -> int:
    """Fork a pool process (function_runtime/standby.py); it listens on spec.socket_path once warmed up."""
    reply = _call(socket_path, m.SpawnStandby(spec=spec, log_path=str(log_path)))
    if not isinstance(reply, m.Spawned):
        raise ProtocolError(f"zygote answered {reply!r} to spawn_standby")
    return reply.pid


def prepare_backbone(socket_path: Path, model_dir: Path) -> m.Prepared:
    return _call(socket_path, m.Prepare(model_dir=str(model_dir)))


def zygote_status(socket_path: Path) -> m.ZygoteStatus:
    return _call(socket_path, m.ZygoteStatusRequest())


def start_zygote(socket_path: Path, log_path: Path, timeout_s: float = 120.0) -> subprocess.Popen:
    """Start a zygote process and wait until it answers."""
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "lorafaas.function_runtime.zygote", str(socket_path)],
            env=child_env(FUNCTION_NICENESS),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
        )
    wait_for_socket(socket_path, timeout_s, process.pid, lambda: zygote_status(socket_path))
    return process


def start_fresh_worker(spec: m.WorkerSpec, log_path: Path) -> subprocess.Popen:
    """A worker in a new interpreter, importing everything itself: what a cold start without the pool costs."""
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "lorafaas.function_runtime.worker", msgspec.json.encode(spec).decode()],
            env=child_env(FUNCTION_NICENESS),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
        )


def wait_for_socket(path: Path, timeout_s: float, pid: int, probe=None) -> None:
    """Wait until `path` accepts connections (and `probe()` succeeds); fail early if `pid` dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise InstanceUnavailable(f"process {pid} exited before listening on {path}")
        if Path(path).exists():
            try:
                if probe is not None:
                    probe()
                else:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                        sock.connect(str(path))
                return
            except (OSError, InstanceUnavailable):
                pass
        time.sleep(0.005)
    raise InstanceUnavailable(f"nothing listened on {path} within {timeout_s} s")


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # reaps it if it is our child and exited
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m lorafaas.function_runtime.zygote SOCKET_PATH", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    forbid_dumping()  # its forks are function workers: none of them dumpable from their first instruction
    take_data_plane_niceness()  # and they inherit its priority, below the daemons' (protocols/priority.py)
    Zygote(Path(args[0])).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
