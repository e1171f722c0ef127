"""A function-like child process for tests: attach to a shared backbone, bind a model, run it, report over stdout.

    python -m lorafaas.testing.attach_probe daemon SOCKET NAME   # lease from a daemon, bind, forward
    python -m lorafaas.testing.attach_probe manifest FILE FD     # attach a SegmentManifest (JSON file) and the
                                                                 # inherited descriptor FD, no model

After its first report the probe reads one `ProbeCommand` (JSON) per stdin line and answers each with a
`ProbeReport` (JSON) line: `report` again (a fresh forward), `write` (write into a backbone tensor: on a read-only
mapping the probe dies with SIGSEGV and answers nothing), `attack` (every way a compromised function might try to
write the weights, each outcome in `attacks`), `detach`, `exit`. `ProbeProcess` drives one from a test,
with timeouts, and always kills it.
"""

from __future__ import annotations

import hashlib
import os
import resource
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import msgspec

# Token ids valid for every test backbone (tiny vocabularies have 512 entries).
PROBE_INPUT_IDS = (1, 5, 7, 9, 100, 200, 300, 42, 17, 256, 511, 3)
PROBE_THREADS = 1  # one intra-op thread everywhere, so results compare bitwise across processes


ProbeAction = Literal["report", "write", "attack", "detach", "exit"]


class ProbeCommand(msgspec.Struct, frozen=True):
    action: ProbeAction


class ProbeReport(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    lease_id: str = ""
    num_parameters: int = 0
    params_in_segment: bool = False  # every parameter's bytes lie in [segment_base, segment_base + segment_size)
    segment_base: int = 0
    segment_size: int = 0
    logits_sha256: str = ""
    tensors_sha256: str = ""  # manifest mode: digest over every tensor's bytes in table order
    attach_s: float = 0.0  # lease + map + empty model + bind, first-use imports included (not the bench's figure)
    bind_s: float = 0.0
    attacks: dict[str, str] = {}  # attempt -> "ok" (it worked) or the errno name it failed with


def attack_segment(fd: int, base_ptr: int, size: int) -> dict[str, str]:
    """Try every way this process (same uid as the daemon) could write the segment it holds the descriptor of and
    maps at [base_ptr, base_ptr + size); each attempt's outcome: "ok" or the errno name."""
    import ctypes
    import errno
    import fcntl
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    def attempt(fn) -> str:
        try:
            fn()
        except OSError as exc:
            return str(exc.errno) if exc.errno is None else errno.errorcode.get(exc.errno, str(exc.errno))
        return "ok"

    def mprotect() -> None:
        page = base_ptr - base_ptr % mmap.PAGESIZE
        if libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")

    def reopen_for_write() -> None:
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            os.pwrite(reopened, b"x", 0)
        finally:
            os.close(reopened)

    def shared_writable_mapping() -> None:
        mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()

    def proc_mem() -> None:  # what a debugger (or ptrace-capable attacker) would write through
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(base_ptr)
            mem.write(b"x")

    return {
        "write": attempt(lambda: os.pwrite(fd, b"x", 0)),
        "ftruncate": attempt(lambda: os.ftruncate(fd, size * 2)),
        "fallocate": attempt(lambda: os.posix_fallocate(fd, 0, size * 2)),
        "reopen_for_write": attempt(reopen_for_write),
        "mmap_shared_writable": attempt(shared_writable_mapping),
        "mprotect_write": attempt(mprotect),
        "proc_self_mem": attempt(proc_mem),
        "change_seals": attempt(lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)),  # F_SEAL_SEAL: refused
    }


def logits_digest(model) -> str:
    """sha256 of the float32 logits of PROBE_INPUT_IDS; equal digests mean bitwise-equal logits."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([PROBE_INPUT_IDS], device=model.device)).logits
    return hashlib.sha256(logits.float().cpu().contiguous().numpy().tobytes()).hexdigest()


def tensors_digest(tensors: dict) -> str:
    import torch

    digest = hashlib.sha256()
    for tensor in tensors.values():
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _run_daemon_mode(socket_path: str, function: str) -> None:
    import torch

    from lorafaas import cuda_ipc
    from lorafaas.errors import SegmentError
    from lorafaas.models.binding import bind_backbone, build_empty_model
    from lorafaas.protocols.daemon_client import DaemonClient

    started = time.perf_counter()
    client = DaemonClient.connect(Path(socket_path), client=function)
    attached = client.attach(function)
    fd = attached.segment_fd  # kept open (a function closes it; a compromised one would keep it)
    if fd is None:
        raise SegmentError(f"the descriptor of lease {attached.lease_id} was closed already")
    attachment = cuda_ipc.attach(attached.manifest, fd)
    model = build_empty_model(Path(attached.backbone.model_dir))
    bind_started = time.perf_counter()
    model = bind_backbone(attachment, Path(attached.backbone.model_dir), model=model)
    done = time.perf_counter()
    params = list(model.parameters())
    in_segment = all(attachment.base_ptr <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size()
                     <= attachment.base_ptr + attachment.size for p in params)

    def report() -> ProbeReport:
        return ProbeReport(pid=os.getpid(), lease_id=attached.lease_id, num_parameters=len(params),
                           params_in_segment=in_segment, segment_base=attachment.base_ptr,
                           segment_size=attachment.size, logits_sha256=logits_digest(model),
                           attach_s=done - started, bind_s=done - bind_started)

    def write() -> None:
        with torch.no_grad():
            params[0].view(-1)[0] += 1.0

    def attack() -> ProbeReport:
        return msgspec.structs.replace(report(), attacks=attack_segment(fd, attachment.base_ptr, attachment.size))

    _command_loop(report, write, lambda: client.detach(attached.lease_id), attack)


def _run_manifest_mode(manifest_file: str, fd: str) -> None:
    import torch

    from lorafaas import cuda_ipc

    manifest = msgspec.json.decode(Path(manifest_file).read_bytes(), type=cuda_ipc.SegmentManifest)
    started = time.perf_counter()
    attachment = cuda_ipc.attach(manifest, int(fd))
    attach_s = time.perf_counter() - started

    def report() -> ProbeReport:
        return ProbeReport(pid=os.getpid(), segment_base=attachment.base_ptr, segment_size=attachment.size,
                           tensors_sha256=tensors_digest(attachment.tensors), attach_s=attach_s,
                           params_in_segment=all(attachment.contains(t) for t in attachment.tensors.values()))

    def write() -> None:
        with torch.no_grad():
            next(iter(attachment.tensors.values())).view(-1)[0] += 1

    def attack() -> ProbeReport:
        return msgspec.structs.replace(report(), attacks=attack_segment(int(fd), attachment.base_ptr, attachment.size))

    _command_loop(report, write, attachment.close, attack)


def _command_loop(report, write, detach, attack) -> None:
    out = sys.stdout.buffer
    out.write(msgspec.json.encode(report()) + b"\n")
    out.flush()
    for line in sys.stdin.buffer:
        command = msgspec.json.decode(line, type=ProbeCommand)
        if command.action == "exit":
            return
        if command.action == "write":
            write()  # faults on a read-only mapping
        elif command.action == "detach":
            detach()
        out.write(msgspec.json.encode(attack() if command.action == "attack" else report()) + b"\n")
        out.flush()


class ProbeProcess:
    """A probe child driven from a test; `kill` (or the context manager's exit) always reaps it."""

    def __init__(self, args: list[str], timeout_s: float = 120.0, pass_fds: tuple[int, ...] = ()) -> None:
        # a file, not a pipe: a chatty child never blocks on it; closed in kill()
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lorafaas.testing.attach_probe", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, pass_fds=pass_fds,
        )
        if self.process.stdin is None or self.process.stdout is None:  # (both pipes: asked for above)
            raise RuntimeError("the probe's pipes were not made")
        self._stdin, self._stdout = self.process.stdin, self.process.stdout
        self.pid = self.process.pid
        self._timeout_s = timeout_s
        self.first: ProbeReport | None = None

    def __enter__(self) -> ProbeProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    def wait_report(self, timeout_s: float | None = None) -> ProbeReport:
        selector = selectors.DefaultSelector()
        selector.register(self._stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s or self._timeout_s):
            self.kill()
            raise TimeoutError(f"probe {self.pid} sent no report within {timeout_s or self._timeout_s} s")
        line = self._stdout.readline()
        if not line:
            self.process.wait(10)
            raise RuntimeError(f"probe {self.pid} exited with {self.process.returncode}: {self.stderr()[-2000:]}")
        report = msgspec.json.decode(line, type=ProbeReport)
        self.first = self.first or report
        return report

    def send(self, action: ProbeAction) -> None:
        self._stdin.write(msgspec.json.encode(ProbeCommand(action)) + b"\n")
        self._stdin.flush()

    def request(self, action: ProbeAction, timeout_s: float | None = None) -> ProbeReport:
        self.send(action)
        return self.wait_report(timeout_s)

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        return self.process.wait(timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self._stdin, self._stdout, self._stderr):
            if not stream.closed:
                stream.close()


def main(argv: list[str]) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a probe that faults on purpose leaves no core file
    import torch

    torch.set_num_threads(PROBE_THREADS)
    mode, *rest = argv
    if mode == "daemon":
        _run_daemon_mode(*rest)
    elif mode == "manifest":
        _run_manifest_mode(*rest)
    else:
        raise SystemExit(f"unknown probe mode {mode!r}; expected daemon or manifest")


if __name__ == "__main__":
    main(sys.argv[1:])
