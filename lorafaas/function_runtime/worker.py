"""The function worker process: one function instance serving its typed protocol on a Unix socket (or, in a pod,
on `tcp://HOST:PORT`).

An asyncio loop owns the socket and the routing of events; a single compute thread owns the instance (staging and
every engine step run there, one at a time), so generation never blocks the loop and requests arriving mid-step join
the batch at the next step.

    python -m lorafaas.function_runtime.worker '<WorkerSpec as JSON>'    # a fresh process (a cold start)
    zygote fork -> run_worker(spec)                                       # libraries already imported
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from lorafaas.errors import InvalidInput, LorafaasError, ServerError
from lorafaas.function_runtime import messages as m
from lorafaas.function_runtime.client import tcp_address
from lorafaas.function_runtime.instance import FunctionInstance
from lorafaas.function_runtime.memory import read_memory
from lorafaas.function_runtime.step_gate import StepGate
from lorafaas.protocols.priority import take_data_plane_niceness
from lorafaas.protocols.process_guard import forbid_dumping, is_dumpable
from lorafaas.wire import encode_frame, read_message

log = logging.getLogger(__name__)
request_decoder = msgspec.msgpack.Decoder(m.Request)


@dataclass
class _Connection:
    writer: asyncio.StreamWriter
    request_ids: set[str] = field(default_factory=set)  # its generations in flight


@dataclass
class _Route:
    """Where one generation's events go, and its timings."""

    connection: _Connection
    arrived_s: float
    first_token_s: float | None = None

    @property
    def writer(self) -> asyncio.StreamWriter:
        return self.connection.writer


class WorkerServer:
    def __init__(self, spec: m.WorkerSpec, tokenizer=None, instance: FunctionInstance | None = None) -> None:
        """`instance`: one loaded already (a pool process given this function), else a new one."""
        self.spec = spec
        self.instance = instance or FunctionInstance(spec, tokenizer)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._gate = StepGate(spec.step_gate) if spec.step_gate else None  # used by the compute thread only
        self._routes: dict[str, _Route] = {}
        self._work = asyncio.Event()
        self._stopped = asyncio.Event()
        self._num_served = 0
        self._num_steps = 0

    async def serve(self) -> None:
        tcp = tcp_address(self.spec.socket_path)
        path = Path(self.spec.socket_path)
        if tcp is not None:  # a pod: the gateway reaches it over the network (a NetworkPolicy admits only the gateway)
            server = await asyncio.start_server(self._handle, host=tcp[0], port=tcp[1])
        else:
            path.unlink(missing_ok=True)
            server = await asyncio.start_unix_server(self._handle, path=str(path))
            path.chmod(0o600)  # only the platform's user may talk to a function instance
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        log.info("%s/%s: listening on %s (pid %d)", self.spec.function, self.spec.instance_id, path, os.getpid())
        compute = asyncio.create_task(self._compute_loop())
        try:
            await self._stopped.wait()
        finally:
            compute.cancel()
            server.close()
            if tcp is None:
                path.unlink(missing_ok=True)
            if "backbone" in self.instance.loaded:
                with contextlib.suppress(LorafaasError, OSError):
                    await self._run(self.instance.unload, "backbone")
            self._compute.shutdown(wait=False, cancel_futures=True)
            if self._gate is not None:
                self._gate.close()
            log.info("%s/%s: stopped", self.spec.function, self.spec.instance_id)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    # -- connections -----------------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer)
        try:
            hello = await read_message(reader, request_decoder)
            if not isinstance(hello, m.Hello) or hello.version != m.PROTOCOL_VERSION:
                self._send(writer, m.ErrorReply(request_id=None, code="protocol_error", message=(
                    f"expected hello with protocol version {m.PROTOCOL_VERSION}, got {hello!r}")))
                return
            self._send(writer, m.HelloReply(version=m.PROTOCOL_VERSION, pid=os.getpid(),
                                            function=self.spec.function, instance_id=self.spec.instance_id))
            while (request := await read_message(reader, request_decoder)) is not None:
                await self._dispatch(request, connection)
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
            self._send(writer, m.ErrorReply(request_id=None, code="protocol_error", message=str(exc)))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            engine = self.instance.engine
            for request_id in connection.request_ids:  # the client went away: stop its work
                if request_id in self._routes and engine is not None:
                    engine.cancel(request_id)
                    self._work.set()
            writer.close()

    async def _dispatch(self, request: m.Request, connection: _Connection) -> None:
        writer = connection.writer
        try:
            if isinstance(request, m.Generate):
                await self._generate(request, connection)
            elif isinstance(request, m.Cancel):
                if request.request_id in connection.request_ids and self.instance.engine is not None:
                    self.instance.engine.cancel(request.request_id)
                    self._work.set()
            elif isinstance(request, m.Stage):
                seconds = await self._run(self.instance.load, request.stage)
                self._send(writer, m.StageDone(stage=request.stage, seconds=seconds, memory=read_memory(),
                                               adapter=self.instance.adapter_stats()))
            elif isinstance(request, m.Unstage):
                seconds = await self._run(self.instance.unload, request.stage)
                self._send(writer, m.StageDone(stage=request.stage, seconds=seconds, memory=read_memory(),
                                               adapter=self.instance.adapter_stats()))
            elif isinstance(request, m.GetStats):
                self._send(writer, self.stats())
            elif isinstance(request, m.Shutdown):
                self._stopped.set()
        except LorafaasError as exc:
            request_id = request.request_id if isinstance(request, m.Generate) else None
            self._send(writer, m.ErrorReply(request_id=request_id, code=exc.code, message=exc.message,
                                            param=getattr(exc, "param", None)))

    async def _generate(self, request: m.Generate, connection: _Connection) -> None:
        arrived = time.perf_counter()
        if request.request_id in self._routes:
            raise InvalidInput(f"request id {request.request_id!r} is already in flight")
        if sum(given is not None for given in (request.prompt, request.messages, request.prompt_token_ids)) != 1:
            raise InvalidInput("give exactly one of prompt, prompt_token_ids and messages")
        if not self.instance.ready or self.instance.engine is None:  # a cold start: load what is not pre-loaded
            await self._run(self.instance.load_for_request)
        engine = self.instance.engine
        if engine is None:  # load_for_request makes one; an unload in between took it away
            raise InvalidInput("the instance's backbone is not loaded")
        if request.messages is not None:
            prompt_ids = engine.encode_chat([msg.template_dict() for msg in request.messages], request.tools)
        elif request.prompt_token_ids is not None:
            prompt_ids = engine.check_token_ids(request.prompt_token_ids)
        elif request.prompt is not None:
            prompt_ids = engine.encode_text(request.prompt)
        else:  # (checked above: exactly one is given)
            raise InvalidInput("give exactly one of prompt, prompt_token_ids and messages")
        engine.add(request.request_id, prompt_ids, request.params)
        self._routes[request.request_id] = _Route(connection, arrived)
        connection.request_ids.add(request.request_id)
        self._work.set()

    # -- compute -------------------------------------------------------------------------------------------------

    async def _compute_loop(self) -> None:
        while True:
            await self._work.wait()
            engine = self.instance.engine
            if engine is None or not engine.has_work():
                self._work.clear()
                if self._gate is not None:
                    await self._run(self._gate.withdraw)
                continue
            try:
                outputs, shared = await self._run(self._step, engine)
                self._num_steps += 1
            except Exception as exc:  # a failed forward pass must fail its requests, not the worker
                log.exception("%s/%s: engine step failed", self.spec.function, self.spec.instance_id)
                self._fail_all(engine, ServerError(f"generation failed: {exc}"))
                continue
            now = time.perf_counter()
            for out in outputs:
                route = self._routes.get(out.request_id)
                if route is None:  # warm-up or a request whose client left
                    continue
                if out.error is not None:  # this request alone failed
                    del self._routes[out.request_id]
                    route.connection.request_ids.discard(out.request_id)
                    self._send(route.writer, m.ErrorReply(request_id=out.request_id, code=InvalidInput.code,
                                                          message=out.error))
                    continue
                if out.token_id is not None:
                    route.first_token_s = route.first_token_s or now
                    self._send(route.writer, m.Token(request_id=out.request_id, token_id=out.token_id, text=out.text,
                                                     prefill_s=out.prefill_s, prefill_batch=out.prefill_batch,
                                                     prefill_shared=shared and out.prefill_s is not None,
                                                     prompt_tokens=out.prompt_tokens if out.prefill_s is not None
                                                     else None, logprobs=out.logprobs))
                if out.finish_reason is not None:
                    del self._routes[out.request_id]
                    route.connection.request_ids.discard(out.request_id)
                    self._num_served += 1
                    self._send(route.writer, m.Finished(
                        request_id=out.request_id, finish_reason=out.finish_reason, text=out.full_text,
                        prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                        ttft_s=(route.first_token_s or now) - route.arrived_s, e2e_s=now - route.arrived_s,
                    ))

    def _step(self, engine) -> tuple[list, bool]:
        """One engine step, on the cores the device's step gate grants (compute thread), and whether it ran in the
        shared base pass: an instance in it sends the step's backbone products there when the grant says so (always,
        without a gate), and tells the pass after each step whether another follows."""
        base_pass, gate = self.instance.base_pass, self._gate
        if gate is not None:
            if base_pass is not None and not base_pass.broken and not gate.member:
                gate.declare_member()
            elif base_pass is not None and base_pass.broken and gate.member:  # a SHARED grant would be unaccounted
                gate.leave_pass()
            gate.acquire()
        shared = base_pass is not None and not base_pass.broken and (gate is None or gate.shared)
        alone_before = base_pass.num_alone_passes if base_pass is not None else 0
        if base_pass is not None:
            base_pass.begin_step(shared=shared)
        outputs = None
        try:
            outputs = engine.step()
            return outputs, shared
        finally:
            again = engine.has_work()
            if gate is not None:  # a prefill, or a pass told ALONE, is no sample of its mode's step time
                told_alone = base_pass is not None and base_pass.num_alone_passes != alone_before
                sample = outputs is not None and not told_alone and all(o.prefill_s is None for o in outputs)
                gate.release(again=again, sample=sample)
            if base_pass is not None:
                base_pass.end_step(again=again)

    def _fail_all(self, engine, error: LorafaasError) -> None:
        for request_id, route in list(self._routes.items()):
            engine.cancel(request_id)
            self._send(route.writer, m.ErrorReply(request_id=request_id, code=error.code, message=error.message))
            del self._routes[request_id]
            route.connection.request_ids.discard(request_id)

    def _send(self, writer: asyncio.StreamWriter, message: msgspec.Struct) -> None:
        if not writer.is_closing():
            writer.write(encode_frame(message))

    def stats(self) -> m.Stats:
        engine = self.instance.engine
        return m.Stats(
            pid=os.getpid(), function=self.spec.function, instance_id=self.spec.instance_id,
            stages=tuple(self.instance.loaded), stage_seconds=dict(self.instance.stage_seconds),
            memory=read_memory(), num_running=engine.num_running if engine else 0, dumpable=is_dumpable(),
            num_waiting=engine.num_waiting if engine else 0, num_served=self._num_served,
            adapter=self.instance.adapter_stats(), num_steps=self._num_steps,
        )


def run_worker(spec: m.WorkerSpec, tokenizer=None) -> int:
    forbid_dumping()  # its adapter, KV cache and base-pass buffer: no /proc/PID/fd or ptrace way in (process_guard)
    take_data_plane_niceness()  # a fresh worker (a forked one has the zygote's already)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{spec.function}/{spec.instance_id}] %(name)s: %(message)s",
    )
    asyncio.run(WorkerServer(spec, tokenizer).serve())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m lorafaas.function_runtime.worker '<WorkerSpec JSON>'", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return run_worker(msgspec.json.decode(args[0], type=m.WorkerSpec))


if __name__ == "__main__":
    sys.exit(main())
