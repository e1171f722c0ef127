"""The LoRA server: one per MoE backbone per node; runs the expert LoRA of many function instances (InfiniLoRA).

    python -m lorafaas.lora_server.server --model-dir DIR --socket PATH [--tcp HOST:PORT] [--capacity M]

It never holds the backbone, only expert adapters: an `AdapterCache` of capacity M (layer-wise loading, frequency
based eviction). Instances connect over a Unix socket (shared-memory buffers, `lora_transport.py`) or, from other
nodes, over TCP; each MoE layer they push two calls (gate/up, then down) and get the deltas back. An asyncio loop owns
the sockets; one compute thread runs batches: every call that arrived while the previous batch ran, from any
instance, grouped by (adapter, expert) (`lora_compute.py`). When ready it prints one JSON line with its addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from lorafaas.cuda_ipc import check_device
from lorafaas.errors import AdapterIncompatible, AdapterInvalid, InvalidInput, LorafaasError, ProtocolError, ServerError
from lorafaas.formats.expert_adapters import (
    ExpertAdapterInfo,
    check_against_layout,
    load_expert_layer,
    read_expert_adapter_info,
    read_expert_layout,
)
from lorafaas.lora_server.cache import AdapterCache
from lorafaas.lora_server.compute import LoraCompute, LoraWork
from lorafaas.protocols import lora_server_messages as m
from lorafaas.protocols.lora_transport import TORCH_DTYPES, DuplexBuffer
from lorafaas.wire import encode_frame, read_message

log = logging.getLogger(__name__)
MAX_ROWS_PER_CALL = 1 << 16
MAX_INLINE_BYTES = 1 << 30


@dataclass(frozen=True)
class LoraServerConfig:
    model_dir: Path  # the backbone's store entry: only its config is read (the MoE layout)
    socket_path: Path | None = None  # Unix socket: the shared-memory transport
    tcp: str | None = None  # "HOST:PORT" (port 0: any free port): the TCP transport
    capacity: int = 8  # adapters resident at once (M)
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int | None = None  # torch intra-op threads of the compute thread
    half_life_accesses: float = 1024.0
    http_baseline_port: int | None = None  # the naive HTTP+JSON transport, for `bench moe-transport` only

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


class LoraServer:
    def __init__(self, config: LoraServerConfig) -> None:
        self.config = config
        self.layout = read_expert_layout(config.model_dir)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.adapters: dict[str, ExpertAdapterInfo] = {}
        self.cache = AdapterCache(config.capacity, self._load_layer, config.half_life_accesses)
        self.compute = LoraCompute(self.cache)
        self.addresses: dict[str, str] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-compute")
        self._pending: list[tuple[LoraWork, asyncio.Future]] = []
        self._draining = False
        self._drainer: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._num_connections = 0
        self._started_s = time.monotonic()

    # -- compute -------------------------------------------------------------------------------------------------

    def _load_layer(self, adapter_id: str, layer: int):
        factors = load_expert_layer(self.adapters[adapter_id], layer, self.config.device)
        return {p: type(f)(a=f.a.to(self.dtype), b=f.b.to(self.dtype), scaling=f.scaling) for p, f in factors.items()}

    async def submit(self, work: LoraWork) -> None:
        """Queue one call for the next batch and wait for its deltas (raises what computing it raised)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((work, future))
        if not self._draining:
            self._draining = True
            self._drainer = asyncio.create_task(self._drain())
        await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await loop.run_in_executor(self._executor, self.compute.run, [w for w, _ in batch])
                except Exception as exc:  # the batch itself failed: fail its calls, keep serving
                    log.exception("LoRA server: a batch of %d calls failed", len(batch))
                    for work, _ in batch:
                        work.error = work.error or exc
                for work, future in batch:
                    if not future.done():
                        future.set_exception(work.error) if work.error else future.set_result(None)
        finally:
            self._draining = False

    def compute_from_thread(self, work: LoraWork) -> None:
        """`submit` for threads outside the event loop (the HTTP baseline)."""
        asyncio.run_coroutine_threadsafe(self.submit(work), self._loop).result()

    # -- adapters ------------------------------------------------------------------------------------------------

    def register(self, adapter_id: str, adapter_dir: str) -> ExpertAdapterInfo:
        known = self.adapters.get(adapter_id)
        if known is not None:
            if Path(known.path) != Path(adapter_dir):
                raise InvalidInput(f"adapter id {adapter_id!r} is registered with {known.path}, not {adapter_dir}")
            return known
        info = read_expert_adapter_info(Path(adapter_dir))
        check_against_layout(info, self.layout, str(self.config.model_dir))
        self.adapters[adapter_id] = info
        log.info(
            "LoRA server: registered adapter %s (rank %d, %d expert bytes)", adapter_id, info.rank, info.expert_bytes
        )
        return info

    def status(self) -> m.ServerStatus:
        stats, cache = self.compute.stats, self.cache
        return m.ServerStatus(
            server_pid=os.getpid(),
            device=self.config.device,
            uptime_s=time.monotonic() - self._started_s,
            num_connections=self._num_connections,
            num_adapters=len(self.adapters),
            num_calls=stats.num_calls,
            num_batches=stats.num_batches,
            max_calls_per_batch=stats.max_calls_per_batch,
            num_groups=stats.num_groups,
            compute_s=stats.compute_s,
            cache=m.CacheStatus(
                capacity=cache.capacity,
                resident=cache.resident_layers(),
                resident_bytes=cache.resident_bytes,
                num_hits=cache.num_hits,
                num_misses=cache.num_misses,
                num_layer_loads=cache.num_layer_loads,
                num_evictions=cache.num_evictions,
            ),
        )

    # -- serving -------------------------------------------------------------------------------------------------

    async def serve(self, on_ready: Callable[[dict[str, str]], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self.config.num_threads:
            await self._loop.run_in_executor(self._executor, torch.set_num_threads, self.config.num_threads)
        servers = []
        if self.config.socket_path is not None:
            path = Path(self.config.socket_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            servers.append(await asyncio.start_unix_server(lambda r, w: self._handle(r, w, "shm"), path=str(path)))
            path.chmod(0o600)
            self.addresses["socket"] = str(path)
        if self.config.tcp is not None:
            host, _, port = self.config.tcp.rpartition(":")
            server = await asyncio.start_server(lambda r, w: self._handle(r, w, "tcp"), host=host, port=int(port))
            servers.append(server)
            self.addresses["tcp"] = f"tcp://{host}:{server.sockets[0].getsockname()[1]}"
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
            on_ready(self.addresses)
        try:
            await self._stop.wait()
        finally:
            for server in servers:
                server.close()
            if self.config.socket_path is not None:
                Path(self.config.socket_path).unlink(missing_ok=True)
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, transport: str) -> None:
        self._num_connections += 1
        buffer: DuplexBuffer | None = None
        try:
            hello = await read_message(reader, m.request_decoder)
            if not isinstance(hello, m.Hello) or hello.protocol_version != m.PROTOCOL_VERSION:
                raise ProtocolError(f"expected hello with protocol version {m.PROTOCOL_VERSION}, got {hello!r}")
            layout = self.layout
            writer.write(
                encode_frame(
                    m.Welcome(
                        protocol_version=m.PROTOCOL_VERSION,
                        server_pid=os.getpid(),
                        device=self.config.device,
                        dtype=self.config.dtype,
                        num_experts=layout.num_experts,
                        hidden_size=layout.hidden_size,
                        intermediate_size=layout.intermediate_size,
                        layers=tuple(sorted(layout.experts_paths)),
                    )
                )
            )
            while (request := await read_message(reader, m.request_decoder)) is not None:
                try:
                    if isinstance(request, m.LoraCall):
                        await self._call(request, buffer, transport, reader, writer)
                    elif isinstance(request, m.AttachBuffer):
                        if transport != "shm":
                            raise InvalidInput("shared-memory buffers are for local (Unix socket) connections")
                        if buffer is not None:
                            buffer.close()
                        buffer = None
                        buffer = DuplexBuffer(request.segment, request.size, create=False)
                        writer.write(encode_frame(m.BufferAttached(segment=request.segment)))
                    elif isinstance(request, m.RegisterAdapter):
                        info = self.register(request.adapter_id, request.adapter_dir)
                        writer.write(
                            encode_frame(
                                m.AdapterRegistered(
                                    adapter_id=request.adapter_id, rank=info.rank, expert_bytes=info.expert_bytes
                                )
                            )
                        )
                    elif isinstance(request, m.Status):
                        writer.write(encode_frame(self.status()))
                    elif isinstance(request, m.Shutdown):
                        writer.write(encode_frame(m.ShuttingDown()))
                        self._stop.set()
                    else:
                        raise ProtocolError(f"unexpected {type(request).__name__} after the handshake")
                except LorafaasError as exc:
                    if isinstance(exc, ProtocolError):
                        raise
                    seq = request.seq if isinstance(request, m.LoraCall) else None
                    writer.write(encode_frame(m.ErrorReply(code=exc.code, message=exc.message, seq=seq)))
                await writer.drain()
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError, ProtocolError) as exc:
            writer.write(encode_frame(m.ErrorReply(code=ProtocolError.code, message=str(exc))))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._num_connections -= 1
            if buffer is not None:
                buffer.close()
            writer.close()

    async def _call(
        self,
        call: m.LoraCall,
        buffer: DuplexBuffer | None,
        transport: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        inline = None
        if isinstance(call.rows, m.InlinePayload):
            if transport != "tcp" or not 0 < call.rows.nbytes <= MAX_INLINE_BYTES:
                raise ProtocolError(f"inline rows of {call.rows.nbytes} bytes on a {transport} connection")
            inline = bytearray(await reader.readexactly(call.rows.nbytes))  # read before checks: stay in sync
        in_features, out_features = self._check_call(call)
        num_rows = sum(call.expert_counts)
        dtype = TORCH_DTYPES[call.dtype]
        if inline is not None:
            if len(inline) != num_rows * in_features * dtype.itemsize:
                raise InvalidInput(
                    f"{len(inline)} bytes of rows; {num_rows} rows x {in_features} {call.dtype} need "
                    f"{num_rows * in_features * dtype.itemsize}"
                )
            rows = torch.frombuffer(inline, dtype=dtype).view(num_rows, in_features)
            result = torch.empty(num_rows, out_features, dtype=dtype)
        else:
            if buffer is None or call.result_offset is None:
                raise InvalidInput("a shared-memory call needs an attached buffer and a result offset")
            rows = buffer.tensor(call.rows.offset, dtype, (num_rows, in_features))
            result = buffer.tensor(call.result_offset, dtype, (num_rows, out_features))
            if (
                call.rows.offset < call.result_offset + result.nbytes
                and call.result_offset < call.rows.offset + rows.nbytes
            ):
                raise InvalidInput("a call's rows and result overlap in the buffer")
        work = LoraWork(
            adapter_id=call.adapter_id,
            layer=call.layer,
            projection=call.projection,
            expert_counts=call.expert_counts,
            rows=rows,
            result=result,
        )
        try:
            await self.submit(work)
        except LorafaasError:
            raise
        except Exception as exc:
            raise ServerError(f"computing the deltas of adapter {call.adapter_id} failed: {exc}") from exc
        payload = m.ShmPayload(offset=call.result_offset) if inline is None else m.InlinePayload(nbytes=result.nbytes)
        writer.write(
            encode_frame(m.LoraResult(seq=call.seq, num_rows=num_rows, out_features=out_features, result=payload))
        )
        if inline is not None:  # the deltas follow the frame
            writer.write(memoryview(result.view(torch.uint8).numpy()).cast("B"))

    def _check_call(self, call: m.LoraCall) -> tuple[int, int]:
        info = self.adapters.get(call.adapter_id)
        if info is None:
            raise AdapterInvalid(f"adapter {call.adapter_id!r} is not registered with this LoRA server")
        if call.projection not in info.projections.get(call.layer, ()):
            raise AdapterIncompatible(
                f"adapter {call.adapter_id!r} does not adapt {call.projection} of layer {call.layer}"
            )
        if call.dtype != self.config.dtype:
            raise InvalidInput(f"rows are {call.dtype}; this LoRA server computes in {self.config.dtype}")
        counts = call.expert_counts
        if len(counts) != self.layout.num_experts or any(c < 0 for c in counts):
            raise InvalidInput(f"expert_counts must be {self.layout.num_experts} non-negative counts, got {counts}")
        if not 0 < sum(counts) <= MAX_ROWS_PER_CALL:
            raise InvalidInput(f"a call carries {sum(counts)} rows; it must carry 1 to {MAX_ROWS_PER_CALL}")
        return self.layout.features(call.projection)


def serve(config: LoraServerConfig, on_ready: Callable[[dict[str, str]], None] | None = None) -> None:
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
        )
        serve(config, on_ready=lambda addresses: print(json.dumps(addresses), flush=True))
    except LorafaasError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidInput) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
