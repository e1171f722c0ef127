"""Statistics of one serving-benchmark level and the machine's load while it ran.

Kept apart from the HTTP client so both are tested on their own: `summarize` turns the outcomes of the requests of
one level into the figures vLLM's `benchmark_serving` reports (TTFT, TPOT = time per output token after the first,
ITL, end-to-end latency), and `LoadProbe` reads what else the machine was doing (load average, every core's busy time,
the CPU time of the server's process tree, and the tree's peak memory), because on a shared machine a figure without
its load means little.
"""

from __future__ import annotations

import os
import threading
import time

import msgspec
import psutil

from lorafaas.stats import percentile


class RequestOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the client saw it; times in seconds from sending it."""

    model: str
    ok: bool
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server counted them (usage), when it said
    chunk_gaps_s: tuple[float, ...] = ()  # between consecutive text chunks (inter-token latency)


class Distribution(msgspec.Struct, frozen=True, kw_only=True):
    """Mean and percentiles, in milliseconds (linear interpolation, numpy's default and vLLM's benchmark's)."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of(cls, values_s: list[float]) -> Distribution:
        if not values_s:
            return cls(mean_ms=0.0, p50_ms=0.0, p90_ms=0.0, p99_ms=0.0)
        ms = [v * 1e3 for v in values_s]
        p50, p90, p99 = (percentile(ms, q, 0.0) for q in (50, 90, 99))  # (ms is not empty)
        return cls(mean_ms=sum(ms) / len(ms), p50_ms=float(p50), p90_ms=float(p90), p99_ms=float(p99))


class MachineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """What the machine did during one level.

    `busy_cores` is every core's non-idle time over the window divided by its length (2.0 = both cores of a 2-core
    machine busy throughout); `server_cores` the same for the server's process tree when its pid was given, and
    `client_cores` for this benchmark's own process; `other_cores` is what is left: everyone else's load.
    """

    cores: int
    loadavg_1m_start: float
    loadavg_1m_end: float
    busy_cores: float
    client_cores: float
    server_cores: float | None = None
    other_cores: float | None = None
    server_pid: int | None = None
    # the most memory the server's process tree held during the level: PSS summed over its processes (a page shared
    # by k of them counts 1/k to each, so shared weights count once), sampled every `pss_sample_interval_s`
    server_pss_peak_mb: float | None = None
    server_pss_samples: int | None = None


PSS_SAMPLE_S = 0.5
# The kernel walks a process's page tables to sum its PSS: a tree of eight SmolLM2 workers and their daemon costs
# 60-70 ms of CPU a sample, which sampled every 0.5 s took 6-19% of the served throughput on two cores. Samples are
# spaced so that the probe spends at most this share of one core.
PSS_PROBE_CORE_SHARE = 0.02


def pss_sample_interval_s(sample_cost_s: float) -> float:
    """The wait before the next PSS sample when the last one cost `sample_cost_s` of CPU."""
    return max(PSS_SAMPLE_S, sample_cost_s / PSS_PROBE_CORE_SHARE)


class LevelResult(msgspec.Struct, frozen=True, kw_only=True):
    """One target at one concurrency level."""

    target: str
    url: str
    concurrency: int
    requests: int
    completed: int
    failed: int
    duration_s: float
    output_tokens: int
    short_replies: int  # completed before `output_len` tokens (EOS or a stop): with --ignore-eos, a server ignoring it
    output_tokens_per_s: float
    requests_per_s: float
    mean_prompt_tokens: float | None
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e_latency: Distribution
    load: MachineLoad
    errors: tuple[str, ...] = ()  # the first few distinct failure messages


def summarize(target: str, url: str, concurrency: int, outcomes: list[RequestOutcome], duration_s: float,
              load: MachineLoad, output_len: int) -> LevelResult:
    """The level's figures: throughput over the wall time of the whole level, latencies over completed requests."""
    done = [o for o in outcomes if o.ok]
    tokens = sum(o.output_tokens for o in done)
    # TPOT as vLLM defines it: the decode time after the first token over the tokens after it (one-token replies
    # have none and are left out).
    tpot = [(o.latency_s - o.ttft_s) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    prompts = [o.prompt_tokens for o in done if o.prompt_tokens is not None]
    errors = tuple(dict.fromkeys(o.error for o in outcomes if not o.ok))[:5]
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return LevelResult(
        target=target, url=url, concurrency=concurrency, requests=len(outcomes), completed=len(done),
        failed=len(outcomes) - len(done), duration_s=duration_s, output_tokens=tokens,
        short_replies=sum(1 for o in done if o.output_tokens < output_len),
        output_tokens_per_s=per_s(tokens), requests_per_s=per_s(len(done)),
        mean_prompt_tokens=sum(prompts) / len(prompts) if prompts else None,
        ttft=Distribution.of([o.ttft_s for o in done]), tpot=Distribution.of(tpot),
        itl=Distribution.of([gap for o in done for gap in o.chunk_gaps_s]),
        e2e_latency=Distribution.of([o.latency_s for o in done]), load=load, errors=errors,
    )


class LoadProbe:
    """Reads the machine's CPU counters at `start()` and `stop()`; the difference is the level's load."""

    def __init__(self, server_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self._me = psutil.Process()
        self._pss_peak = 0
        self._pss_samples = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._load0 = os.getloadavg()[0]
        self._busy0 = _busy_seconds()
        self._client0 = _own_cpu(self._me)
        self._server0 = _tree_cpu(self.server_pid) if self.server_pid else {}
        if self.server_pid:
            self._pss_peak, self._pss_samples = 0, 0
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample_pss, name="pss-sampler", daemon=True)
            self._sampler.start()

    def _sample_pss(self) -> None:
        wait_s = 0.0
        while not self._stop.wait(wait_s):
            wait_s = pss_sample_interval_s(self._take_pss_sample())

    def _take_pss_sample(self) -> float:
        """One sample into the peak; returns the CPU seconds it cost (this thread's alone)."""
        cpu0 = time.thread_time()
        self._pss_peak = max(self._pss_peak, tree_pss_bytes(self.server_pid))  # type: ignore[arg-type]
        self._pss_samples += 1
        return time.thread_time() - cpu0

    def stop(self) -> MachineLoad:
        pss_mb = None
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None
            self._take_pss_sample()
            pss_mb = self._pss_peak / 2**20
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        busy = (_busy_seconds() - self._busy0) / elapsed
        client = (_own_cpu(self._me) - self._client0) / elapsed
        server = other = None
        if self.server_pid:
            after = _tree_cpu(self.server_pid)
            # a process started during the level counts from zero; one that ended during it is lost (psutil cannot
            # read the CPU time of a reaped process), so `server_cores` is a lower bound
            server = sum(cpu - self._server0.get(pid, 0.0) for pid, cpu in after.items()) / elapsed
            other = max(busy - server - client, 0.0)
        return MachineLoad(cores=psutil.cpu_count() or 1, loadavg_1m_start=self._load0,
                           loadavg_1m_end=os.getloadavg()[0], busy_cores=busy, client_cores=client,
                           server_cores=server, other_cores=other, server_pid=self.server_pid,
                           server_pss_peak_mb=pss_mb,
                           server_pss_samples=self._pss_samples if self.server_pid else None)


def _busy_seconds() -> float:
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    return sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


def _own_cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and each live descendant (none if `pid` is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of `pid` and each live descendant."""
    seconds = {}
    for process in process_tree(pid):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        seconds[process.pid] = times.user + times.system
    return seconds


def tree_pss_bytes(pid: int) -> int:
    """PSS of `pid` and every live descendant, summed (0 if it is gone). Read from /proc/PID/smaps_rollup, which
    the kernel sums for us: reading every mapping's smaps costs a large process milliseconds."""
    total = 0
    for process in process_tree(pid):
        try:
            with open(f"/proc/{process.pid}/smaps_rollup") as rollup:
                for line in rollup:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # ended between the listing and the read, or not ours to read
    return total
