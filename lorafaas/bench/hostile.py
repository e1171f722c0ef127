"""`lorafaas bench hostile`: honest members' TPOT and outputs in the shared base pass while one member attacks
(issue 36, acceptance 2: within 1.5x of their TPOT alone, outputs equal to their outputs alone, the attacker alone
evicted).

A real backbone daemon serves the backbone from a scratch home. The honest members are `--members` processes
(`python -m lorafaas.testing.base_pass_probe`, one thread each, different prompts) that decode `--steps` greedy tokens
and report their tokens and each step's time. They run, started together each time:

    alone     each its own pass (`--alone`), none in the daemon's shared pass
    calm      all in the shared pass, nobody attacking: once before each attack, its baseline (the machine's load
              drifts over minutes; a ratio to the calm run just before is a ratio to the same load, near enough)
    attacked  all in the shared pass while one attacker runs, once per attack (findings 1-5 of issue 36)

The attacker is a fresh process (`python -m lorafaas.bench.hostile attack NAME ...`) holding its own lease, started
and set going just before the members start, stopped once they have reported:

    1 lm-head-flood  a member joins and calls the LM-head group with its max rows (1024) out of any pass, in a loop;
                     hung up on, it joins again (every ATTACK_PAUSE_S) and goes on
    2 sealed-buffer  hellos whose buffer memfd is sealed F_SEAL_SHRINK|F_SEAL_WRITE (the daemon's mmap fails)
    3 idle-active    a member that sends END with AGAIN (another step follows) and never starts a pass
    4 bogus-groups   a first hello (before any honest member's) naming one layer group, then more of them
    5 proc-fd        a process of the same uid opening /proc/<daemon>/fd/*, /proc/<daemon>/map_files/* and
                     /proc/<daemon>/mem in a loop; as root, it and the daemon both run under
                     `capsh --drop=cap_sys_ptrace` (else the capability, not the daemon, decides), beside a dumpable
                     control process it must be able to open (so a refusal is the daemon's doing)

TPOT is each member's median step time (every step recomputes the whole sequence: no KV cache), and a phase's
figure the median over the members. Who was hung up on or refused is read from the daemon's log by pid, and each
honest member reports whether its base-pass client broke. The attacker's loops pause ATTACK_PAUSE_S between tries:
its own CPU is its cgroup's matter, not the daemon's, and on a small machine an unpaced loop measures the contention
for cores rather than the daemon's defences.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec

from lorafaas.config import LorafaasConfig
from lorafaas.errors import ServerError
from lorafaas.formats.model_store import ModelStore
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.protocols.daemon_client import DaemonClient, wait_until_ready
from lorafaas.protocols.daemon_config import DaemonPaths
from lorafaas.testing.child_process import stderr_tail, stop_child

ATTACKS = ("lm-head-flood", "sealed-buffer", "idle-active", "bogus-groups", "proc-fd")  # findings 1-5
ATTACK_PAUSE_S = 0.005
PROMPT_LENGTH = 8
LIMIT = 1.5  # acceptance 2: TPOT attacked within 1.5x
TIMEOUT_S = 900.0


class AttackRow(msgspec.Struct, frozen=True, kw_only=True):
    finding: int
    attack: str
    tpot_s: float  # the honest members' median TPOT during the attack
    member_tpot_s: list[float]
    calm_tpot_s: float  # the honest members' median TPOT in the calm run just before this attack
    over_calm: float  # tpot_s / calm_tpot_s
    over_alone: float
    within_limit_of_calm: bool  # over_calm <= 1.5
    within_limit_of_alone: bool
    outputs_equal_alone: bool  # every honest member's tokens equal its tokens alone
    outputs_equal_calm: bool  # ... equal its tokens in the calm run before
    max_logit_diff_alone: float  # the largest |last logits attacked - alone| over the members
    attacker_evicted: bool  # hung up on or refused by the daemon (its log, by the attacker's pid)
    attacker_served: int  # what it got: calls computed, hellos accepted, descriptors or memory of the daemon opened
    honest_kept: bool  # no honest member hung up on or refused by the daemon, nor its client broken
    member_calls: list[int]  # calls each honest member had computed by the daemon (0: every pass computed alone)
    outcome: str
    attacker: dict[str, int | str]  # its own counters
    attacker_cpu_s: float  # CPU time the attacker's process took while it attacked (its own cores' cost)
    attack_s: float  # how long it attacked (set going to stopped)
    daemon_said: list[str]  # the daemon's log lines naming a pid it hung up on or refused, distinct, at most 8


class HostileBenchResult(msgspec.Struct, frozen=True, kw_only=True):
    backbone: str
    members: int
    steps: int
    limit: float
    tpot_alone_s: float
    tpot_calm_s: float  # the median of the calm runs'
    member_tpot_alone_s: list[float]
    calm_runs_tpot_s: list[float]  # each calm run's (one before each attack)
    calm_over_alone: float
    calm_outputs_equal_alone: bool  # in every calm run
    attacks: list[AttackRow]


def prompts(members: int) -> list[list[int]]:
    """Distinct prompts of small token ids (valid in any vocabulary the platform serves)."""
    return [[(1 + i + (2 * i + 3) * j) % 97 + 1 for j in range(PROMPT_LENGTH - i % 3)] for i in range(members)]


def run_hostile_bench(home: Path, backbone: str, members: int = 2, steps: int = 24,
                      attacks: tuple[str, ...] = ATTACKS, progress: ProgressSink | None = None) -> HostileBenchResult:
    progress = progress or SilentProgress()
    if members < 2 or steps < 1:
        raise ValueError(f"members {members} must be at least 2 (a pass is shared) and steps {steps} at least 1")
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        raise ValueError(f"unknown attacks {sorted(unknown)}; they are {', '.join(ATTACKS)}")
    store = ModelStore(LorafaasConfig(home=Path(home)).models_dir)
    if not store.exists(backbone):
        from lorafaas.platform.builtin_backbones import BUILTIN_BACKBONES, import_builtin

        if backbone in BUILTIN_BACKBONES:
            progress.stage(f"importing the built-in {backbone}")
            import_builtin(store, backbone, progress)
    source = store.path(backbone)
    store.get(backbone)  # NotFound, named, if it is not there
    with tempfile.TemporaryDirectory(prefix="lorafaas-bench-hostile-") as scratch:
        scratch_home = Path(scratch)
        progress.stage(f"copying {backbone} into a scratch home")
        ModelStore(scratch_home / "models").import_dir(backbone, source)
        with _daemon(scratch_home, backbone) as (paths, log):
            bench = _Bench(paths, log, prompts(members), steps)
            progress.stage("honest members alone", 1)
            alone = bench.members(alone=True)
            progress.advance()
            rows, calms = [], []
            for attack in attacks:
                progress.stage(f"calm, then attack {ATTACKS.index(attack) + 1}: {attack}", 2)
                calms.append(bench.members(alone=False))
                progress.advance()
                rows.append(bench.attacked(attack, alone, calms[-1]))
                progress.advance()
    tpot_alone = _tpot(alone)
    calm_runs = [statistics.median(_tpot(calm)) for calm in calms]
    tpot_calm = statistics.median(calm_runs) if calm_runs else float("nan")
    return HostileBenchResult(
        backbone=backbone, members=members, steps=steps, limit=LIMIT,
        tpot_alone_s=statistics.median(tpot_alone), tpot_calm_s=tpot_calm, member_tpot_alone_s=tpot_alone,
        calm_runs_tpot_s=calm_runs, calm_over_alone=tpot_calm / statistics.median(tpot_alone),
        calm_outputs_equal_alone=all(_same_tokens(calm, alone) for calm in calms), attacks=rows,
    )


def _tpot(reports: list[dict]) -> list[float]:
    return [statistics.median(r["step_s"]) for r in reports]


def _same_tokens(a: list[dict], b: list[dict]) -> bool:
    return all(x["tokens"] == y["tokens"] for x, y in zip(a, b, strict=True))


def _without_ptrace() -> bool:
    """As root the kernel lets CAP_SYS_PTRACE through `/proc/PID/fd` whatever the target: drop it (capsh)."""
    return os.geteuid() == 0 and shutil.which("capsh") is not None


def _wrapped(command: list[str]) -> list[str]:
    return ["capsh", "--drop=cap_sys_ptrace", "--", "-c", "exec " + shlex.join(command)] if _without_ptrace() \
        else command


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


@contextlib.contextmanager
def _daemon(home: Path, backbone: str):
    """The backbone's daemon (its base pass on), without CAP_SYS_PTRACE as the proc-fd attacker has none."""
    paths = DaemonPaths.of(home, backbone, "cpu")
    log = home / "daemon.log"
    command = [sys.executable, "-m", "lorafaas.backbone_daemon", backbone, "--device", "cpu", "--home", str(home),
               "--reap-interval", "0.2"]
    with log.open("ab") as err:
        process = subprocess.Popen(_wrapped(command), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=err, env=_env())
    try:
        try:
            wait_until_ready(paths.socket, 300.0, process)
        except Exception as exc:
            raise ServerError(f"the backbone daemon did not start: {log.read_text()[-1500:]}") from exc
        yield paths, log
    finally:
        stop_child(process, 30)


class _Bench:
    def __init__(self, paths: DaemonPaths, log: Path, prompts: list[list[int]], steps: int) -> None:
        self.paths, self.log, self.prompts, self.steps = paths, log, prompts, steps

    def members(self, alone: bool, before_go=None) -> list[dict]:
        """Every prompt decoded at once by its own honest member process; their reports (with their pids)."""
        with contextlib.ExitStack() as stack:
            errors = [stack.enter_context(tempfile.TemporaryFile()) for _ in self.prompts]
            probes = [subprocess.Popen(
                [sys.executable, "-m", "lorafaas.testing.base_pass_probe", str(self.paths.socket),
                 str(self.paths.base_pass), str(self.steps), *map(str, prompt), *(["--alone"] if alone else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
                for prompt, err in zip(self.prompts, errors, strict=True)]
            try:
                for probe, err in zip(probes, errors, strict=True):
                    line = probe.stdout.readline()  # type: ignore[union-attr]
                    if not line or not json.loads(line).get("ready"):
                        raise ServerError(f"an honest member exited with {probe.wait()} before it was ready: "
                                          f"{stderr_tail(err)}")
                for probe in probes:
                    probe.stdin.write("go\n")  # type: ignore[union-attr]
                    probe.stdin.flush()  # type: ignore[union-attr]
                reports = []
                for probe, err in zip(probes, errors, strict=True):
                    line = probe.stdout.readline()  # type: ignore[union-attr]
                    if not line:
                        raise ServerError(f"an honest member exited with {probe.wait()}: {stderr_tail(err)}")
                    reports.append(json.loads(line) | {"pid": probe.pid})
                return reports
            finally:
                for probe in probes:
                    probe.kill()
                    probe.wait()

    def attacked(self, attack: str, alone: list[dict], calm: list[dict]) -> AttackRow:
        finding = ATTACKS.index(attack) + 1
        log_from = self.log.stat().st_size
        with _Attacker(attack, self.paths) as attacker:
            shared = self.members(alone=False)
        counters = attacker.counters
        text = self.log.read_bytes()[log_from:].decode(errors="replace")
        hung_up, refused = _log_pids(text)
        honest_pids = {r["pid"] for r in shared}
        evicted = attacker.pid in hung_up | refused
        tpot = _tpot(shared)
        tpot_s = statistics.median(tpot)
        calm_tpot_s = statistics.median(_tpot(calm))
        over_calm = tpot_s / calm_tpot_s
        over_alone = tpot_s / statistics.median(_tpot(alone))
        served = _served(attack, counters)
        return AttackRow(
            finding=finding, attack=attack, tpot_s=tpot_s, member_tpot_s=tpot, calm_tpot_s=calm_tpot_s,
            over_calm=over_calm,
            over_alone=over_alone, within_limit_of_calm=over_calm <= LIMIT, within_limit_of_alone=over_alone <= LIMIT,
            outputs_equal_alone=_same_tokens(shared, alone), outputs_equal_calm=_same_tokens(shared, calm),
            max_logit_diff_alone=max(max(abs(a - b) for a, b in zip(x["logits"], y["logits"], strict=True))
                                     for x, y in zip(shared, alone, strict=True)),
            attacker_evicted=evicted, attacker_served=served,
            honest_kept=not honest_pids & (hung_up | refused) and not any(r["broken"] for r in shared),
            member_calls=[r["calls"] for r in shared],
            outcome=_outcome(attack, counters, evicted, served), attacker=counters, daemon_said=_said(text),
            attacker_cpu_s=attacker.cpu_s, attack_s=attacker.attack_s,
        )


def _log_pids(text: str) -> tuple[set[int], set[int]]:
    """The pids the daemon's base pass hung up on and refused, from its log."""
    hung_up = {int(p) for p in re.findall(r"base pass: hanging up on pid (\d+)", text)}
    refused = {int(p) for p in re.findall(r"base pass: refused pid (\d+)", text)}
    return hung_up, refused


def _said(text: str) -> list[str]:
    said: list[str] = []
    for line in text.splitlines():
        found = re.search(r"base pass: (hanging up on|refused) pid .*", line)
        if found and found.group(0) not in said and len(said) < 8:
            said.append(found.group(0))
    return said


def _served(attack: str, c: dict) -> int:
    if attack == "lm-head-flood":
        return int(c["served"])
    if attack in ("sealed-buffer", "bogus-groups"):
        return int(c["accepted"])
    if attack == "proc-fd":
        return int(c["fds_opened"]) + int(c["maps_opened"]) + int(c["mem_opened"])
    return 0  # idle-active: it asks nothing to be computed; what it could cost is the others' waiting


def _outcome(attack: str, c: dict, evicted: bool, served: int) -> str:
    if attack == "lm-head-flood":
        return (f"{'hung up on' if evicted else 'NOT hung up on'}, {c['served']} calls computed, "
                f"joined {c['welcomed']}x, refused at accept {c['refused']}x")
    if attack in ("sealed-buffer", "bogus-groups"):
        return f"{c['accepted']} of {c['hellos']} hellos accepted ({c['why']!r})"
    if attack == "idle-active":
        return (f"{'hung up on' if evicted else 'kept (no rule evicts it)'}: {c['ends']} END AGAIN sent, "
                f"never a pass")
    if not c.get("meaningful", 1):
        return "not meaningful: root without capsh (CAP_SYS_PTRACE opens everything)"
    return (f"opened {served} of the daemon's ({c['fds_listed']} fds listed, {c['probes']} tries); "
            f"the dumpable control: {c['control_opened']} opened")



class _Attacker:
    """The attacker process: started, set going (its attack under way) before the honest members start, stopped
    after they report; its counters."""

    def __init__(self, attack: str, paths: DaemonPaths) -> None:
        self.attack, self.paths = attack, paths
        self.counters: dict[str, int | str] = {}
        self.control: subprocess.Popen | None = None
        self.cpu_s = self.attack_s = 0.0

    def __enter__(self) -> _Attacker:
        args = [self.attack, str(self.paths.socket), str(self.paths.base_pass)]
        if self.attack == "proc-fd":
            with DaemonClient.connect(self.paths.socket, client="bench-hostile") as daemon:
                daemon_pid = daemon.status().daemon_pid
            holder = ("import os, time; fd = os.memfd_create('control'); print(os.getpid(), flush=True); "
                      "time.sleep(3600)")
            self.control = subprocess.Popen(_wrapped([sys.executable, "-c", holder]), stdout=subprocess.PIPE,
                                            text=True, env=_env())
            args += [str(daemon_pid), self.control.stdout.readline().strip(),  # type: ignore[union-attr]
                     str(int(_without_ptrace() or os.geteuid() != 0))]
        command = [sys.executable, "-m", "lorafaas.bench.hostile", "attack", *args]
        self.err = tempfile.TemporaryFile()
        self.process = subprocess.Popen(_wrapped(command) if self.attack == "proc-fd" else command,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                        env=_env())
        self.pid = self.process.pid  # `exec` under capsh: the same process
        try:
            self._expect("ready")
            self.process.stdin.write("go\n")  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
            self._expect("going")  # its attack is under way (attack 4: its first hello refused)
            self._going = (time.monotonic(), _cpu_s(self.pid))
        except BaseException:
            self._stop()
            raise
        return self

    def _expect(self, word: str) -> None:
        line = self.process.stdout.readline().strip()  # type: ignore[union-attr]
        if line != word:
            raise ServerError(f"the {self.attack} attacker said {line!r}, exited {self.process.poll()}: "
                              f"{stderr_tail(self.err)}")

    def __exit__(self, *exc_info) -> None:
        try:
            if exc_info[0] is None:
                self.attack_s = time.monotonic() - self._going[0]
                self.cpu_s = _cpu_s(self.pid) - self._going[1]
                out, _ = self.process.communicate("stop\n", timeout=120)
                if self.process.returncode != 0:
                    raise ServerError(f"the {self.attack} attacker exited {self.process.returncode}: "
                                      f"{stderr_tail(self.err)}")
                self.counters = json.loads(out.strip().splitlines()[-1])
        finally:
            self._stop()

    def _stop(self) -> None:
        for process in (self.process, self.control):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        self.err.close()


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process `pid` (its threads included) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the attacker process: `python -m lorafaas.bench.hostile attack NAME DAEMON_SOCKET PASS_SOCKET [...]`


def _stopped(stop: threading.Event, pause: float = ATTACK_PAUSE_S) -> bool:
    return stop.wait(pause)


def _member_groups(daemon_socket: str) -> tuple[DaemonClient, list]:
    """A lease on the backbone (what a member holds) and the layer groups a real member of it sends."""
    from lorafaas.models.base_pass_groups import backbone_groups
    from lorafaas.models.binding import bind_backbone

    client = DaemonClient.connect(Path(daemon_socket), client="bench-hostile-attacker")
    attached = client.attach("hostile-attacker")
    attachment = attached.map()
    model = bind_backbone(attachment, Path(attached.backbone.model_dir))
    return client, list(backbone_groups(model, attachment.tensors))


def _flood(pass_socket: str, groups: list, stop: threading.Event, c: dict) -> None:
    """Finding 1: LM-head calls of 1024 rows in a loop, out of any pass; hung up on, it joins again."""
    from lorafaas.protocols import base_pass as bp
    from lorafaas.testing.base_pass_member import RawMember

    last = len(groups) - next(i for i, g in enumerate(reversed(groups)) if not g.tail) - 1  # the LM head group
    c.update(served=0, hung_up=0, welcomed=0, refused=0)
    while not stop.is_set():
        attacker = None
        try:  # a buffer for 1024 rows of the widest group: at most MAX_BUFFER_BYTES (sparse until written)
            attacker = RawMember(pass_socket, groups, max_rows=1024, size=bp.MAX_BUFFER_BYTES, timeout_s=60)
            welcomed = attacker.welcome().accepted
        except OSError:  # refused at accept: evicted lately
            welcomed = False
            if attacker is not None:
                attacker.close()
        else:
            c["welcomed"] += welcomed
            try:
                while welcomed and not stop.is_set():
                    if attacker.call(last, 1024) != bp.DONE:
                        c["hung_up"] += 1
                        break
                    c["served"] += 1
            except OSError:
                c["hung_up"] += 1
            attacker.close()
        if not welcomed:
            c["refused"] += 1
            _stopped(stop)


def _hellos(pass_socket: str, groups: list, stop: threading.Event, c: dict, seals: int, once: bool) -> None:
    """Findings 2 and 4: hellos the daemon must refuse (a write-sealed buffer; one layer group), again and again
    (`once`: one, now)."""
    from lorafaas.testing.base_pass_member import RawMember

    for key, zero in (("hellos", 0), ("accepted", 0), ("refused", 0), ("why", "")):
        c.setdefault(key, zero)
    while once or not stop.is_set():
        try:
            member = RawMember(pass_socket, groups, seals=seals)
        except OSError:
            c["refused"] += 1
        else:
            c["hellos"] += 1
            try:
                welcome = member.welcome()
                c["accepted"] += welcome.accepted
                c["refused"] += not welcome.accepted
                c["why"] = welcome.message or c["why"]
            except OSError:
                c["refused"] += 1
            member.close()
        if once:
            return
        _stopped(stop)


def _idle(pass_socket: str, groups: list, stop: threading.Event, c: dict) -> None:
    """Finding 3: joins, says another step follows (END with AGAIN), and never starts a pass."""
    from lorafaas.testing.base_pass_member import RawMember

    c.update(welcomed=0, ends=0, hung_up=0)
    member = RawMember(pass_socket, groups)
    c["welcomed"] += member.welcome().accepted
    try:
        while not stop.is_set():
            member.end(again=True)
            c["ends"] += 1
            _stopped(stop, 0.05)
            member.sock.setblocking(False)
            try:
                if member.sock.recv(1) == b"":
                    c["hung_up"] += 1
                    return
            except BlockingIOError:
                pass
            finally:
                member.sock.setblocking(True)
    except OSError:
        c["hung_up"] += 1
    finally:
        member.close()


def _proc(daemon_pid: int, control_pid: int, stop: threading.Event, c: dict) -> None:
    """Finding 5: a process of the same uid opening the daemon's descriptors, mappings and memory through /proc."""
    def try_open(path: str) -> bool:
        try:
            os.close(os.open(path, os.O_RDONLY))
        except OSError:
            return False
        return True

    def listing(path: str) -> list[str]:
        with contextlib.suppress(OSError):
            return os.listdir(path)
        return []

    c.update(probes=0, fds_listed=0, fds_opened=0, maps_opened=0, mem_opened=0,
             control_opened=sum(try_open(f"/proc/{control_pid}/fd/{n}") for n in listing(f"/proc/{control_pid}/fd")))
    while not stop.is_set():
        c["probes"] += 1
        fds = listing(f"/proc/{daemon_pid}/fd")
        c["fds_listed"] = max(c["fds_listed"], len(fds))
        c["fds_opened"] += sum(try_open(f"/proc/{daemon_pid}/fd/{n}") for n in fds)
        c["maps_opened"] += sum(try_open(f"/proc/{daemon_pid}/map_files/{n}")
                                for n in listing(f"/proc/{daemon_pid}/map_files"))
        c["mem_opened"] += try_open(f"/proc/{daemon_pid}/mem")
        _stopped(stop)


def attack_main(argv: list[str]) -> int:
    """Say `ready` (lease held, groups known), start the attack on `go`, say `going`, stop on `stop` (or end of
    stdin) and print the counters as one JSON line."""
    attack, daemon_socket, pass_socket, *rest = argv
    counters: dict = {}
    stop = threading.Event()
    lease, groups = (None, []) if attack == "proc-fd" else _member_groups(daemon_socket)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 2
    import fcntl

    if attack == "lm-head-flood":
        run = threading.Thread(target=_flood, args=(pass_socket, groups, stop, counters))
    elif attack == "sealed-buffer":
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE
        run = threading.Thread(target=_hellos, args=(pass_socket, groups, stop, counters, seals, False))
    elif attack == "bogus-groups":
        _hellos(pass_socket, groups[:1], stop, counters, fcntl.F_SEAL_SHRINK, True)  # the first hello
        run = threading.Thread(target=_hellos, args=(pass_socket, groups[:1], stop, counters, fcntl.F_SEAL_SHRINK,
                                                     False))
    elif attack == "idle-active":
        run = threading.Thread(target=_idle, args=(pass_socket, groups, stop, counters))
    else:
        counters["meaningful"] = int(rest[2])
        run = threading.Thread(target=_proc, args=(int(rest[0]), int(rest[1]), stop, counters))
    run.start()
    time.sleep(0.05)  # under way
    print("going", flush=True)
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 1.0)
        if readable:
            sys.stdin.readline()
            break
    stop.set()
    run.join(timeout=60)
    print(json.dumps(counters), flush=True)
    if lease is not None:
        lease.close()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["attack"]:
        sys.exit("usage: python -m lorafaas.bench.hostile attack NAME DAEMON_SOCKET PASS_SOCKET [...]")
    sys.exit(attack_main(sys.argv[2:]))
