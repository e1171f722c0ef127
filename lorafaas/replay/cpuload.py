"""How busy the machine's cores are besides a local platform's function workers, sampled during a live replay.

    python -m lorafaas.replay.cpuload --home HOME --out cpuload.json [--interval 0.25]   (until SIGINT/SIGTERM)

Every interval (Linux `/proc`): the runnable threads of the whole machine (`procs_running` in /proc/stat, less this
sampler) and those of the platform's function workers (the processes forked by the library pool of HOME, whose
command line names `HOME/run/zygote.sock`). The difference is the background the simulator's CPU device shares its
cores with: everything it does not model as a busy instance (other programs, and the platform's gateway, agent and
daemon, and the replay client). Start it just before `lorafaas replay`; `python -m lorafaas.replay.compare
--cpu-load cpuload.json` aligns its first sample with the replay's start (a second or two early).
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from pathlib import Path

PROC = Path("/proc")


def machine_runnable() -> int:
    for line in (PROC / "stat").read_text().splitlines():
        if line.startswith("procs_running "):
            return max(0, int(line.split()[1]) - 1)  # less this sampler, which is running while it reads
    return 0


def _cmdline(pid: str) -> str:
    try:
        return (PROC / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stat_fields(path: Path) -> list[str] | None:
    """Fields of a /proc stat file after the command name (state first, then ppid)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def worker_pids(home: Path) -> list[str]:
    """Processes forked by HOME's library pool (the pool itself is the one whose parent is not among them)."""
    needle = f"{home}/run/zygote.sock"
    pool = [pid for pid in (p.name for p in PROC.iterdir() if p.name.isdigit()) if needle in _cmdline(pid)]
    parents = {pid: (_stat_fields(PROC / pid / "stat") or ["", ""])[1] for pid in pool}
    return [pid for pid, ppid in parents.items() if ppid in parents]


def runnable_threads(pids: list[str]) -> int:
    count = 0
    for pid in pids:
        try:
            tasks = list((PROC / pid / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            fields = _stat_fields(task / "stat")
            if fields and fields[0] == "R":
                count += 1
    return count


def sample(home: Path, out: Path, interval_s: float, stop: threading.Event, rescan_s: float = 1.0) -> dict:
    started_wall, started = time.time(), time.perf_counter()
    samples: list[list[float]] = []
    workers: list[str] = []
    last_scan = -rescan_s
    while not stop.is_set():
        now = time.perf_counter() - started
        if now - last_scan >= rescan_s:  # instances come and go
            workers, last_scan = worker_pids(home), now
        total, mine = machine_runnable(), runnable_threads(workers)
        samples.append([round(now, 3), total, mine])
        stop.wait(interval_s)
    document = {"home": str(home), "started_wall": started_wall, "interval_s": interval_s,
                "columns": ["t_s", "machine_runnable", "worker_runnable"], "samples": samples}  # fmt: skip
    out.write_text(json.dumps(document))
    return document


def background_series(document: dict, window_s: float = 5.0) -> list[tuple[float, float]]:
    """(start of each window, mean runnable threads other than the workers in it), from t = 0."""
    sums: dict[int, list[float]] = {}
    for t, total, mine in document["samples"]:
        acc = sums.setdefault(int(t // window_s), [0.0, 0.0])
        acc[0] += max(0.0, total - mine)
        acc[1] += 1
    return [(k * window_s, acc[0] / acc[1]) for k, acc in sorted(sums.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", type=Path, required=True, help="the platform's home (its library pool's socket)")
    parser.add_argument("--out", type=Path, default=Path("cpuload.json"))
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    document = sample(args.home.resolve(), args.out, max(0.05, args.interval), stop)
    series = background_series(document)
    mean = sum(b for _, b in series) / len(series) if series else 0.0
    print(f"{len(document['samples'])} samples; background runnable threads: mean {mean:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
