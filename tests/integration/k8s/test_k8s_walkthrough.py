"""docs/kubernetes.md's walk-through ("Try it on one machine"), followed as written (issue 38, acceptance 4): every
`bash` block of that section, in order, is one bash script run from the repository root. It starts
`scripts/k8s-testenv.sh start 3` (the real control plane, three process nodes), installs the chart with default
values through `helm`, port-forwards the gateway with `kubectl`, deploys and invokes a function through it, and stops
the cluster.

While it runs, the pods' processes are watched in /proc: the function pod's worker runs as the chart's uid (10001) in
a PID namespace other than its node agent's daemon, and maps the very memfd the daemon made (the same inode), so the
descriptor hand-off works across PID namespaces as a non-root uid. After `stop`, none of the processes the
walk-through started is left (they are told by a marker in the PYTHONPATH every one of them inherits, or by their
/etc/hosts), nor any of its pods' mounts.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from k8s_env import require_process_kubelet

from tests.support.k8s_cluster import default_bin_dir, missing_binaries

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "kubernetes.md"
SECTION = "## Try it on one machine"
GATEWAY_PORT = 8080  # the port the walk-through forwards
CHART_UID = 10001  # securityContext.runAsUser's default


def walkthrough_blocks() -> list[str]:
    """The section's ```bash blocks, in order."""
    text = DOC.read_text()
    start = text.index(f"\n{SECTION}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"^```bash\n(.*?)^```$", text[start:end if end != -1 else None], re.MULTILINE | re.DOTALL)


def test_the_walkthrough_starts_a_three_node_cluster_and_ends_with_an_invocation() -> None:
    script = "\n".join(walkthrough_blocks())
    assert "bash scripts/k8s-testenv.sh start 3 &" in script
    assert script.index("helm install lorafaas manifests/charts/lorafaas") < script.index("lorafaas invoke pirate")
    assert script.index("kubectl port-forward svc/lorafaas-controller") < script.index("lorafaas invoke pirate")
    assert script.rstrip().endswith("bash scripts/k8s-testenv.sh stop")


@dataclass
class Seen:
    """What the watcher saw of one container process (pid 1 of a PID namespace of its own)."""

    pod: str
    uid: int
    pid_namespace: str
    memfds: set[int] = field(default_factory=set)  # inodes of the memfds it maps


def marked_processes(marker: str, work_dir: Path) -> list[int]:
    """The walk-through's processes: those with the marker in their environment, and the pods' processes whose
    /etc/hosts is a file of the walk-through's kubelet (a process that rewrites its title, as redis-server does,
    overwrites its environment)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if marker.encode() in (entry / "environ").read_bytes() or any(
                        fields[4] == "/etc/hosts" and fields[3].startswith(str(work_dir))
                        for fields in map(str.split, (entry / "mountinfo").read_text().splitlines())):
                    pids.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return pids


def look(pid: int) -> Seen | None:
    proc = Path("/proc") / str(pid)
    try:
        status = dict(line.split(":\t", 1) for line in (proc / "status").read_text().splitlines() if ":\t" in line)
        if len(status.get("NSpid", "").split()) < 2:  # not inside a pod's PID namespace (kubelet, unshare, ...)
            return None
        env = dict(item.split("=", 1) for item in (proc / "environ").read_bytes().decode().split("\0") if "=" in item)
        memfds = {int(line.split()[4]) for line in (proc / "maps").read_text().splitlines()
                  if len(line.split()) > 5 and line.split()[5].startswith("/memfd:")}
        return Seen(env.get("HOSTNAME", ""), int(status["Uid"].split()[0]), os.readlink(proc / "ns" / "pid"), memfds)
    except (OSError, ValueError, KeyError, IndexError):
        return None


class Watcher(threading.Thread):
    def __init__(self, marker: str, work_dir: Path) -> None:
        super().__init__(daemon=True, name="walkthrough-watcher")
        self.marker = marker
        self.work_dir = work_dir
        self.seen: dict[int, Seen] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            for pid in marked_processes(self.marker, self.work_dir):
                now = look(pid)
                if now is None:
                    continue
                before = self.seen.get(pid)
                if before is None or (now.memfds and not before.memfds):
                    # first seen, or first seen mapping a segment: as it is then (a look can come before the
                    # container's exec into its uid, and a pid can be reused)
                    self.seen[pid] = now
                else:
                    before.memfds |= now.memfds


def require_tools() -> None:
    missing = missing_binaries(default_bin_dir()) + [t for t in ("kubectl", "curl") if shutil.which(t) is None]
    if missing:
        reason = f"the walk-through needs {', '.join(missing)}"
        if os.environ.get("LORAFAAS_REQUIRE_K8S") == "1":
            pytest.fail(f"{reason}; LORAFAAS_REQUIRE_K8S=1 forbids skipping", pytrace=False)
        pytest.skip(reason)
    require_process_kubelet()
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", GATEWAY_PORT)) == 0:
            pytest.fail(f"port {GATEWAY_PORT}, which the walk-through forwards, is taken on this machine")


def test_the_walkthrough_runs_as_written_on_three_process_nodes(tmp_path: Path) -> None:
    require_tools()
    marker = str(tmp_path / "walkthrough-marker")  # a PYTHONPATH entry that exists nowhere: inherited by everything
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "LORAFAAS_URL", "LORAFAAS_API_KEY")}
    env |= {"PYTHONPATH": f"{ROOT}:{marker}", "LORAFAAS_K8S_RUN": str(tmp_path / "run"),
            "LORAFAAS_HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp")}
    script = "set -euo pipefail -x\n" + "\n".join(walkthrough_blocks())
    log = tmp_path / "walkthrough.log"
    watcher = Watcher(marker, tmp_path)
    watcher.start()
    with log.open("wb") as out:
        walk = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        code = walk.wait(timeout=1800)
    finally:  # the cluster stopped as the walk-through stops it (its pods' mounts and network go), then the rest
        subprocess.run(["bash", "scripts/k8s-testenv.sh", "stop"], cwd=ROOT, env=env, capture_output=True,
                       timeout=120)
        if walk.poll() is None:
            os.killpg(walk.pid, signal.SIGKILL)
            walk.wait()
        watcher.done.set()
        watcher.join()
        left = marked_processes(marker, tmp_path)
        for pid in left:  # the test's own cleanup; the assertion below reports them
            os.kill(pid, signal.SIGKILL)
    output = log.read_text(errors="replace")
    assert code == 0, output[-6000:]
    assert "deployed pirate" in output
    answer = output.split("+ lorafaas invoke pirate", 1)[1].split("\n", 1)[1].split("\n+ kill", 1)[0]
    assert answer.strip(), output[-3000:]
    assert left == [], f"processes left after stop: {left}"
    assert str(tmp_path) not in Path("/proc/self/mounts").read_text(), "mounts left after stop"

    workers = [s for s in watcher.seen.values() if s.pod.startswith("lorafaas-fn-pirate-") and s.memfds]
    daemons = [s for s in watcher.seen.values() if s.pod.startswith("lorafaas-node-agent-") and s.memfds]
    assert workers and daemons, watcher.seen
    for worker in workers:
        assert worker.uid == CHART_UID
        [daemon] = [d for d in daemons if d.memfds & worker.memfds]  # its daemon's very copy of the weights
        assert daemon.uid == CHART_UID
        assert daemon.pid_namespace != worker.pid_namespace
