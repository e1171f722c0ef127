"""The LoRA server: one per MoE backbone per node; runs the expert LoRA of many function instances (InfiniLoRA).

    python -m lorafaas.lora_server.server --model-dir DIR --socket PATH [--tcp HOST:PORT] [--capacity M]

It never holds the backbone, only expert adapters: an `AdapterCache` of capacity M (layer-wise loading, frequency
based eviction). Instances connect over a Unix socket (memfd buffers, `lora_transport.py`) or, from other
nodes, over TCP; each MoE layer they push two calls (gate/up, then down) and get the deltas back. An asyncio loop owns
the sockets; one compute thread runs batches: every call that arrived while the previous batch ran, from any
instance, grouped by (adapter, expert) (`compute.py`). When ready it prints one JSON line with its addresses
and its shutdown token.

Isolation (docs/moe.md, "Against a hostile client"): each connection is a `Session` (`session.py`) on a socket of its
own, every wait a client controls bounded (`connection.py`); a buffer arrives as a sealed memfd descriptor, never a
name; adapters are the connection's own (`adapters.py`); each client's calls are charged to its budget
(`client_policy.py`); whatever fails while serving one connection refuses or hangs up on that connection alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafaas.cuda_ipc import check_device
from lorafaas.errors import InvalidInput, LorafaasError, ServerError
from lorafaas.formats.expert_adapters import ExpertAdapterInfo, load_expert_layer, read_expert_layout
from lorafaas.lora_server.adapters import AdapterRegistry, ConnectionAdapters
from lorafaas.lora_server.cache import AdapterCache
from lorafaas.lora_server.client_policy import ClientLimits, ClientPolicy, Peer
from lorafaas.lora_server.compute import LoraCompute, LoraWork
from lorafaas.lora_server.session import Session
from lorafaas.protocols import lora_server_messages as m
from lorafaas.protocols.lora_transport import TORCH_DTYPES
from lorafaas.protocols.process_guard import forbid_dumping
from lorafaas.protocols.socket_path import BoundPath

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraServerConfig:
    model_dir: Path  # the backbone's store entry: only its config is read (the MoE layout)
    socket_path: Path | None = None  # Unix socket: the shared-memory transport
    tcp: str | None = None  # "HOST:PORT" (port 0: any free port): the TCP transport
    capacity: int = 8  # adapters resident at once (M)
    device: str = "cpu"
    dtype: m.DType = "float32"
    num_threads: int | None = None  # torch intra-op threads of the compute thread
    half_life_accesses: float = 1024.0
    http_baseline_port: int | None = None  # the naive HTTP+JSON transport, for `bench moe-transport` only
    client_share: float = 0.25  # of the compute thread's time, per client (`client_policy.py`)
    client_burst_s: float = 0.25
    hello_timeout_s: float = 10.0
    frame_timeout_s: float = 10.0
    send_timeout_s: float = 10.0

    @property
    def limits(self) -> ClientLimits:
        return ClientLimits(share=self.client_share, burst_s=self.client_burst_s, hello_timeout_s=self.hello_timeout_s,
                            frame_timeout_s=self.frame_timeout_s, send_timeout_s=self.send_timeout_s)

    def __post_init__(self) -> None:
        if self.socket_path is None and self.tcp is None:
            raise InvalidInput("the LoRA server needs a Unix socket path, a TCP address, or both")
        if not 1 <= self.capacity <= 100_000:
            raise InvalidInput(f"capacity is {self.capacity} adapters; it must lie between 1 and 100000")
        if self.dtype not in TORCH_DTYPES:
            raise InvalidInput(f"dtype is {self.dtype!r}; expected one of {', '.join(TORCH_DTYPES)}")
        check_device(self.device)
        if self.tcp is not None:
            host, _, port = self.tcp.rpartition(":")
            if not host or not port.isdigit() or int(port) > 65535:
                raise InvalidInput(f"TCP address {self.tcp!r} is not HOST:PORT")
        try:
            self.limits  # noqa: B018 - checks the client limits
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc


class LoraServer:
    def __init__(self, config: LoraServerConfig) -> None:
        self.config = config
        self.layout = read_expert_layout(config.model_dir)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.registry = AdapterRegistry(self.layout, str(config.model_dir))
        self.policy = ClientPolicy(config.limits)
        self.cache = AdapterCache(config.capacity, self._load_layer, config.half_life_accesses)
        self.compute = LoraCompute(self.cache)
        self.addresses: dict[str, str] = {}
        self.token = secrets.token_hex(16)  # what Shutdown must carry: the spawner has it, no function does
        self.num_refused = 0
        self._http_adapters = ConnectionAdapters(self.registry)  # the HTTP baseline's ids (bench only)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-compute")
        self._pending: list[_Queued] = []
        self._draining = False
        self._drainer: asyncio.Task | None = None
        self._arrived: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._sessions: set[asyncio.Task] = set()
        self.num_connections = 0
        self._started_s = time.monotonic()

    # -- compute -------------------------------------------------------------------------------------------------

    def _load_layer(self, key: str, layer: int):
        fd = self.registry.open_weights(key)
        try:
            weights = None if fd is None else Path(f"/proc/self/fd/{fd}")
            factors = load_expert_layer(self.registry.info(key), layer, self.config.device, weights)
        finally:
            if fd is not None:
                os.close(fd)
        return {p: type(f)(a=f.a.to(self.dtype), b=f.b.to(self.dtype), scaling=f.scaling) for p, f in factors.items()}

    async def submit(self, work: LoraWork, peer: Peer) -> None:
        """Queue one call (its `adapter_id` a registry key) for a coming batch, as `peer`'s budget allows, and wait
        for its deltas (raises what computing it raised)."""
        future = asyncio.get_running_loop().create_future()
        in_features, out_features = work.rows.shape[1], work.result.shape[1]
        self._pending.append(_Queued(work, future, peer, work.rows.shape[0] * (in_features + out_features)))
        if self._arrived is not None:
            self._arrived.set()
        if not self._draining:
            self._draining = True
            self._drainer = asyncio.create_task(self._drain())
        await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        self._arrived = asyncio.Event()
        try:
            while self._pending:
                now = time.monotonic()
                calls = [(q.peer, q.work.rows.shape[0], q.deferred) for q in self._pending]
                chosen, waiting = self.policy.select(calls, now)
                for i in waiting:
                    self._pending[i].deferred = True
                if not chosen:  # every queued call waits for its client's budget: until one refills or a call comes
                    self._arrived.clear()
                    wake = self.policy.next_refill([self._pending[i].peer for i in waiting], now)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._arrived.wait(), max(wake - now, 0.001))
                    continue
                taken = set(chosen)
                batch = [self._pending[i] for i in chosen]
                self._pending = [q for i, q in enumerate(self._pending) if i not in taken]
                started = time.monotonic()
                try:
                    await loop.run_in_executor(self._executor, self.compute.run, [q.work for q in batch])
                except Exception as exc:  # the batch itself failed: fail its calls, keep serving
                    log.exception("LoRA server: a batch of %d calls failed", len(batch))
                    for queued in batch:
                        queued.work.error = queued.work.error or exc
                now = time.monotonic()
                self.policy.charge([(q.peer, q.cost) for q in batch], now - started, now)
                for queued in batch:
                    if not queued.future.done():
                        error = queued.work.error
                        queued.future.set_exception(error) if error else queued.future.set_result(None)
        finally:
            self._draining = False

    def compute_from_thread(self, work: LoraWork) -> None:
        """`submit` for threads outside the event loop (the HTTP baseline: its adapter ids are its own)."""
        work.adapter_id = self._http_adapters.key(work.adapter_id)
        if self._loop is None:
            raise ServerError("the LoRA server is not serving yet")
        asyncio.run_coroutine_threadsafe(self.submit(work, ("http",)), self._loop).result()

    def register(self, adapter_id: str, adapter_dir: str) -> ExpertAdapterInfo:
        """Register for the HTTP baseline (by path; `bench moe-transport` only)."""
        return self._http_adapters.register(adapter_id, adapter_dir, None)

    def forget(self, keys: list[str]) -> None:
        """Adapters no connection holds any more leave the cache (on the compute thread, which owns it)."""
        for key in keys:
            self._executor.submit(self.cache.forget, key)

    def status(self, own: dict[str, str] | None = None) -> m.ServerStatus:
        """`own`: the asking connection's ids -> keys; its adapters are shown by its ids, others' by a number."""
        names = {key: adapter_id for adapter_id, key in (own or {}).items()}
        resident = self.cache.resident_layers()
        stats, cache = self.compute.stats, self.cache
        return m.ServerStatus(
            server_pid=os.getpid(),
            device=self.config.device,
            uptime_s=time.monotonic() - self._started_s,
            num_connections=self.num_connections,
            num_adapters=len(self.registry),
            num_calls=stats.num_calls,
            num_batches=stats.num_batches,
            max_calls_per_batch=stats.max_calls_per_batch,
            num_groups=stats.num_groups,
            compute_s=stats.compute_s,
            cache=m.CacheStatus(
                capacity=cache.capacity,
                resident={names.get(key, f"#{i}"): layers for i, (key, layers) in enumerate(resident.items())},
                resident_bytes=cache.resident_bytes,
                num_hits=cache.num_hits,
                num_misses=cache.num_misses,
                num_layer_loads=cache.num_layer_loads,
                num_evictions=cache.num_evictions,
            ),
            num_deferred=self.policy.num_deferred,
            num_refused=self.num_refused,
        )

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    # -- serving -------------------------------------------------------------------------------------------------

    async def serve(self, on_ready: Callable[[dict[str, str]], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self.config.num_threads:
            await self._loop.run_in_executor(self._executor, torch.set_num_threads, self.config.num_threads)
        listeners: list[tuple[socket.socket, str]] = []
        bound: BoundPath | None = None
        if self.config.socket_path is not None:
            path = Path(self.config.socket_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))
            bound = BoundPath(path)  # mode 0600; removed at stop only while still this server's
            listeners.append((listener, "shm"))
            self.addresses["socket"] = str(path)
        if self.config.tcp is not None:
            host, _, port = self.config.tcp.rpartition(":")
            listener = socket.create_server((host, int(port)))
            listeners.append((listener, "tcp"))
            self.addresses["tcp"] = f"tcp://{host}:{listener.getsockname()[1]}"
        accepting = []
        for listener, transport in listeners:
            listener.listen(128)
            listener.setblocking(False)
            accepting.append(asyncio.create_task(self._accept(listener, transport)))
        if self.config.http_baseline_port is not None:
            from lorafaas.lora_server.http_baseline import start_http_baseline

            self.addresses["http"] = start_http_baseline(self, self.config.http_baseline_port)
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self._loop.add_signal_handler(sig, self._stop.set)
        log.info(
            "LoRA server %d: %d experts x %d MoE layers, capacity %d adapters, serving %s",
            os.getpid(),
            self.layout.num_experts,
            len(self.layout.experts_paths),
            self.config.capacity,
            self.addresses,
        )
        if on_ready is not None:
            on_ready({**self.addresses, "token": self.token})
        try:
            await self._stop.wait()
        finally:
            for task in accepting:
                task.cancel()
            for listener, _ in listeners:
                listener.close()
            for task in list(self._sessions):
                task.cancel()
            if bound is not None:  # not a successor's socket, bound at the same path while this one stopped
                bound.unlink()
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _accept(self, listener: socket.socket, transport: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of descriptors, say: this connection is lost, not the listener
                log.warning("LoRA server: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(Session(self, sock, transport).run())
            self._sessions.add(task)
            task.add_done_callback(self._sessions.discard)


@dataclass
class _Queued:
    work: LoraWork
    future: asyncio.Future
    peer: Peer
    cost: float  # rows x (in + out): its part of its batch's time
    deferred: bool = False


def serve(config: LoraServerConfig, on_ready: Callable[[dict[str, str]], None] | None = None) -> None:
    """Serve until stopped. This process becomes not dumpable first: it maps every client's buffer and holds every
    client's adapter directory open, which no other process of the uid may reach through its /proc/PID."""
    forbid_dumping()
    asyncio.run(LoraServer(config).serve(on_ready))


def spawn_lora_server(
    config: LoraServerConfig, *, timeout_s: float = 60.0, stderr=None, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, dict[str, str]]:
    """Start a LoRA server process; returns it and its addresses once it serves."""
    command = [
        sys.executable,
        "-m",
        "lorafaas.lora_server.server",
        "--model-dir",
        str(config.model_dir),
        "--capacity",
        str(config.capacity),
        "--device",
        config.device,
        "--dtype",
        config.dtype,
    ]
    if config.socket_path is not None:
        command += ["--socket", str(config.socket_path)]
    if config.tcp is not None:
        command += ["--tcp", config.tcp]
    if config.num_threads:
        command += ["--threads", str(config.num_threads)]
    if config.http_baseline_port is not None:
        command += ["--http-baseline-port", str(config.http_baseline_port)]
    command += ["--client-share", str(config.client_share), "--client-burst", str(config.client_burst_s),
                "--hello-timeout", str(config.hello_timeout_s), "--frame-timeout", str(config.frame_timeout_s),
                "--send-timeout", str(config.send_timeout_s)]
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, **(extra_env or {})},
    )
    line = _read_line(process, timeout_s)
    if not line:
        process.kill()
        process.wait()
        raise ServerError(f"the LoRA server exited with code {process.returncode} before serving")
    return process, json.loads(line)


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    assert process.stdout is not None  # started with stdout=PIPE
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            process.kill()
            process.wait()
            raise ServerError(f"the LoRA server did not start within {timeout_s:.0f} s")
    return process.stdout.readline()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorafaas.lora_server.server", description=__doc__)
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--socket", type=Path, default=None)
    parser.add_argument("--tcp", default=None, help="HOST:PORT for other nodes (port 0: any free port)")
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--http-baseline-port", type=int, default=None)
    parser.add_argument("--client-share", type=float, default=0.25, help="of the compute time, per client")
    parser.add_argument("--client-burst", type=float, default=0.25, help="seconds of compute a client may bank")
    parser.add_argument("--hello-timeout", type=float, default=10.0)
    parser.add_argument("--frame-timeout", type=float, default=10.0)
    parser.add_argument("--send-timeout", type=float, default=10.0)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = LoraServerConfig(
            model_dir=args.model_dir,
            socket_path=args.socket,
            tcp=args.tcp,
            capacity=args.capacity,
            device=args.device,
            dtype=args.dtype,
            num_threads=args.threads,
            http_baseline_port=args.http_baseline_port,
            client_share=args.client_share,
            client_burst_s=args.client_burst,
            hello_timeout_s=args.hello_timeout,
            frame_timeout_s=args.frame_timeout,
            send_timeout_s=args.send_timeout,
        )
        serve(config, on_ready=lambda addresses: print(json.dumps(addresses), flush=True))
    except LorafaasError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidInput) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
