"""The shared backbone is immutable for real: a sealed memfd passed by descriptor, on the tiny backbone, real processes.

- A function process of the daemon's own uid cannot write the weights by any route (write, ftruncate, reopening the
  descriptor through /proc, a shared writable mapping, mprotect, /proc/self/mem, changing the seals); nothing of the
  segment has a name in /dev/shm; other functions' answers stay bitwise those of a private load.
- A function process that sees neither /dev/shm nor the home (a private mount namespace: tmpfs over both, only its
  socket directory, its adapter and the backbone's config and tokenizer bound back) serves the same tokens.
- A daemon that cannot reserve its segment fails once, with 507 naming the bytes needed and free, and the launcher
  does not start it again before its backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import pytest
import torch

import lorafaas.platform.backends.local_daemons as launcher_module
from lorafaas.cuda_ipc.memfd import available_memory_bytes
from lorafaas.cuda_ipc.shm import list_segments
from lorafaas.errors import InsufficientMemory
from lorafaas.function_runtime import messages as m
from lorafaas.function_runtime.client import WorkerClient
from lorafaas.function_runtime.zygote import wait_for_socket
from lorafaas.models.reference import greedy_generate, load_backbone, with_adapter
from lorafaas.platform.backends.local import LocalLauncher
from lorafaas.protocols.daemon_client import DaemonClient
from lorafaas.protocols.daemon_config import DaemonPaths
from lorafaas.testing.attach_probe import PROBE_THREADS, ProbeProcess, logits_digest
from lorafaas.testing.child_process import stop_child
from lorafaas.testing.tiny_models import save_tiny_adapter
from tests.support.packed_reference import packed_like_the_daemon

BACKBONE = "tiny-dense"
PROMPT = "Tell me about the ocean."


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_dense_dir) -> Path:
    home = tmp_path_factory.mktemp("sealed")
    LocalLauncher(home).store.import_dir(BACKBONE, tiny_dense_dir)
    return home


@pytest.fixture(scope="module")
def launcher(home: Path):
    with LocalLauncher(home) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def reference_digest(tiny_dense_dir) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(PROBE_THREADS)
    try:
        return logits_digest(packed_like_the_daemon(load_backbone(tiny_dense_dir)[0]))  # the daemon's default
    finally:
        torch.set_num_threads(threads)


def _memfd_fds(pid: int, prefix: str) -> list[Path]:
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a descriptor closed meanwhile (the listing's own)
            if os.readlink(fd).startswith(f"/memfd:{prefix}"):
                found.append(fd)
    return found


def test_a_function_of_the_same_uid_cannot_write_the_backbone_by_any_route(launcher, home, reference_digest) -> None:
    socket_path = launcher.daemon_socket(BACKBONE)
    with DaemonClient.connect(socket_path) as client:
        daemon_pid = client.status().daemon_pid
    with ProbeProcess(["daemon", str(socket_path), "fn-attacker"]) as attacker, \
            ProbeProcess(["daemon", str(socket_path), "fn-victim"]) as victim:
        attacker.wait_report()
        assert victim.wait_report().logits_sha256 == reference_digest
        attacks = attacker.request("attack").attacks
        assert attacks == {
            "write": "EPERM",  # F_SEAL_WRITE
            "ftruncate": "EPERM",  # F_SEAL_SHRINK / F_SEAL_GROW
            "fallocate": "EPERM",
            "reopen_for_write": "EPERM",  # /proc/self/fd/N opens the same sealed file
            "mmap_shared_writable": "EPERM",
            "mprotect_write": "EACCES",  # the read-only shared mapping may never become writable
            "proc_self_mem": "EIO",  # not even through the kernel's debugger path
            "change_seals": "EPERM",  # F_SEAL_SEAL
        }
        # No path names the segment but the descriptors themselves: none in /dev/shm, and every descriptor that
        # reaches it (the daemon's, the launcher's duplicate, the attacker's) refuses writes.
        assert list_segments(DaemonPaths.of(home, BACKBONE, "cpu").segment_prefix) == []
        holders = [daemon_pid, os.getpid(), attacker.pid]
        prefix = DaemonPaths.of(home, BACKBONE, "cpu").segment_prefix
        paths = [fd for pid in holders for fd in _memfd_fds(pid, prefix)]
        assert {p.parts[2] for p in paths} == {str(pid) for pid in holders}
        for path in paths:
            with contextlib.suppress(PermissionError):  # opening may be refused outright; else writing must be
                fd = os.open(path, os.O_RDWR)
                try:
                    with pytest.raises(PermissionError):
                        os.pwrite(fd, b"\0" * 4, 0)
                finally:
                    os.close(fd)
        assert victim.request("report").logits_sha256 == reference_digest  # the others' answers are unchanged
        assert attacker.request("report").logits_sha256 == reference_digest


def _reference_ids(home: Path, adapter: Path, max_tokens: int) -> list[int]:
    model, tokenizer = load_backbone(home / "models" / BACKBONE)
    return greedy_generate(with_adapter(model, adapter).merge_and_unload(), tokenizer, PROMPT, max_tokens).token_ids


def _can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "none", "/mnt"],
                           capture_output=True, timeout=30)
    return None if probe.returncode == 0 else f"no private mount namespace here: {probe.stderr.decode()[:200]}"


def _restricted_command(spec: m.WorkerSpec, home: Path, stage: Path) -> list[str]:
    """A shell run in a private mount namespace: tmpfs over /dev/shm and the home, then only the worker's socket
    directory, its adapter and the backbone's non-weight files bound back; checks the restriction, then execs the
    worker."""
    model_dir, adapter_dir, run_dir = Path(spec.model_dir), Path(spec.adapter_dir), Path(spec.socket_path).parent
    visible = [p for p in model_dir.iterdir() if p.is_file() and p.suffix != ".safetensors"]
    q = shlex.quote
    lines = ["set -e", f"mkdir -p {q(str(stage / 'run'))} {q(str(stage / 'adapter'))} {q(str(stage / 'model'))}",
             f"mount --bind {q(str(run_dir))} {q(str(stage / 'run'))}",
             f"mount --bind {q(str(adapter_dir))} {q(str(stage / 'adapter'))}"]
    for path in visible:
        lines += [f"touch {q(str(stage / 'model' / path.name))}",
                  f"mount --bind {q(str(path))} {q(str(stage / 'model' / path.name))}"]
    lines += ["mount -t tmpfs none /dev/shm", f"mount -t tmpfs none {q(str(home))}",
              f"mkdir -p {q(str(run_dir))} {q(str(adapter_dir))} {q(str(model_dir))}",
              f"mount --bind {q(str(stage / 'run'))} {q(str(run_dir))}",
              f"mount --bind {q(str(stage / 'adapter'))} {q(str(adapter_dir))}"]
    for path in visible:
        lines += [f"touch {q(str(path))}", f"mount --bind {q(str(stage / 'model' / path.name))} {q(str(path))}"]
    top = " ".join(sorted({p.relative_to(home).parts[0] for p in (run_dir, adapter_dir, model_dir)}))
    lines += [  # the restriction holds: no weights file, nothing in /dev/shm, nothing else of the home
        f"test ! -e {q(str(model_dir / 'model.safetensors'))}", 'test -z "$(ls -A /dev/shm)"',
        f'test "$(ls -A {q(str(home))} | tr "\\n" " ")" = "{top} "',
        f"exec {q(sys.executable)} -m lorafaas.function_runtime.worker {q(msgspec.json.encode(spec).decode())}"]
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)]


def test_a_function_without_dev_shm_or_the_home_serves_from_the_socket_alone(launcher, home, tmp_path) -> None:
    reason = _can_unshare()
    if reason is not None:
        pytest.skip(reason)
    adapter = save_tiny_adapter(home / "adapters" / "alpha", home / "models" / BACKBONE, seed=3, rank=4)
    spec = launcher.spec("alpha", BACKBONE, adapter)
    log_path = tmp_path / "worker.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(_restricted_command(spec, home, tmp_path / "stage"), stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=log, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        wait_for_socket(Path(spec.socket_path), 120, process.pid)

        async def generate() -> list[int]:
            async with await WorkerClient.connect(spec.socket_path, client="test") as worker:
                request = m.Generate(request_id=uuid.uuid4().hex, messages=(m.ChatMessage("user", PROMPT),),
                                     params=m.SamplingParams(max_tokens=8))
                return [e.token_id async for e in worker.generate(request) if isinstance(e, m.Token)]

        ids = asyncio.run(asyncio.wait_for(generate(), 120))
        assert ids == _reference_ids(home, adapter, 8), log_path.read_text()[-3000:]
        with DaemonClient.connect(launcher.daemon_socket(BACKBONE)) as client:
            assert "alpha" in {lease.function for lease in client.status().leases}  # it attached by descriptor
    finally:
        stop_child(process, 15)


def _store_entry_larger_than_memory(home: Path, name: str) -> int:
    """A copy of tiny-dense whose vocabulary makes the embedding larger than twice the node's free memory: config,
    safetensors header and store manifest agree; the data is a sparse file (never read: the reservation fails first).
    Returns the bytes its segment needs."""
    source, entry = home / "models" / BACKBONE, home / "models" / name
    shutil.copytree(source, entry)
    vocab = 2 * available_memory_bytes() // (64 * 4) + 1
    config = json.loads((entry / "config.json").read_text())
    config["vocab_size"] = vocab
    (entry / "config.json").write_text(json.dumps(config))
    weights = entry / "model.safetensors"
    data = weights.read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    offset, sizes = 0, {"F32": 4, "BF16": 2, "F16": 2}
    for key in sorted(k for k in header if k != "__metadata__"):
        if key.endswith("embed_tokens.weight") or key == "lm_head.weight":
            header[key]["shape"] = [vocab, header[key]["shape"][1]]
        nbytes = sizes[header[key]["dtype"]] * math.prod(header[key]["shape"])
        header[key]["data_offsets"] = [offset, offset + nbytes]
        offset += nbytes
    encoded = json.dumps(header).encode()
    with open(weights, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        f.truncate(8 + len(encoded) + offset)  # sparse: no byte of it is ever read
    manifest = json.loads((entry / "lorafaas.json").read_text())
    manifest.update(name=name, bytes=offset, weights_sha256="0" * 64)
    (entry / "lorafaas.json").write_text(json.dumps(manifest))
    return offset


def test_a_daemon_that_cannot_reserve_its_segment_fails_once_with_507_and_backs_off(home, monkeypatch) -> None:
    needed = _store_entry_larger_than_memory(home, "tiny-huge")
    starts: list[str] = []
    spawn = launcher_module.spawn_daemon

    def counting_spawn(config, **kwargs):
        starts.append(config.backbone)
        return spawn(config, **kwargs)

    monkeypatch.setattr(launcher_module, "spawn_daemon", counting_spawn)
    with LocalLauncher(home) as launcher:
        with pytest.raises(InsufficientMemory) as first:
            launcher.daemon_socket("tiny-huge")
        assert first.value.http_status == 507 and first.value.code == "insufficient_memory"
        message = first.value.message
        assert int(re.search(r"needs (\d+) bytes", message).group(1)) >= needed
        assert re.search(r"needs (\d+) bytes of memory; (\d+) bytes are free", message), message
        assert str(home) not in message  # no server path in what a client may see
        with pytest.raises(InsufficientMemory, match="next try in"):  # the backoff: not started again
            launcher.daemon_socket("tiny-huge")
        assert starts == ["tiny-huge"]
        assert launcher.running_backbones() == []
