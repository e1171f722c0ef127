"""A baseline for `lorafaas bench serve`: plain transformers + PEFT serving several LoRA adapters in one process.

What a user gets without a serving system: the backbone loaded once (`AutoModelForCausalLM`), every adapter loaded
into one `PeftModel` by name, and one worker thread that takes every waiting request (up to `--max-batch`), left-pads
them and runs one greedy `model.generate(..., adapter_names=[one per row])` (PEFT's mixed-adapter batch inference)
for the batch's longest `max_tokens`. A request arriving while a batch runs waits for the next one.

    python -m lorafaas.bench.peft_server --model MODEL_DIR --adapter NAME=ADAPTER_DIR [--adapter ...] \\
        [--device cpu|cuda:0] [--dtype float32|bfloat16] [--host 127.0.0.1] --port P [--max-batch 32]

`POST /v1/completions` takes exactly the fields `bench serve` sends: `model` (an adapter name), `prompt` (text or
token ids), `max_tokens`, `temperature` (0 only, the default here), `stream`, `stream_options.include_usage` and
vLLM's `ignore_eos` (no stop at EOS, which may still be generated); any other field is a 400 naming it. A stream is
one chunk with the whole text, the usage chunk, then `data: [DONE]`: its TTFT is its end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lorafaas.errors import LorafaasError, NotFound, ServerError
from lorafaas.platform.gateway.openai_errors import InvalidParameter, openai_status, param_of

logger = logging.getLogger(__name__)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)
    temperature: float = 0.0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("temperature")
    @classmethod
    def _greedy_only(cls, value: float) -> float:
        if value != 0:
            raise ValueError(f"temperature {value} is not supported: this server decodes greedily (temperature 0)")
        return value


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Choice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "peft-server"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    batches: int  # generate calls so far
    rows: int  # requests they answered: rows / batches is the mean batch size


@dataclass(frozen=True)
class Row:
    adapter: str
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]


def generate_batch(model: Any, rows: Sequence[Row], pad_id: int, eos_ids: frozenset[int]) -> list[Generated]:
    """One left-padded, greedy `generate` over `rows`, each with its own adapter; each row cut to its own length."""
    import torch

    width = max(len(row.prompt_ids) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row.prompt_ids):] = torch.tensor(row.prompt_ids)
        attention_mask[i, width - len(row.prompt_ids):] = 1
    no_stop = {"eos_token_id": None} if any(row.ignore_eos for row in rows) else {}  # rows without it cut below
    with torch.inference_mode():
        output = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                                adapter_names=[row.adapter for row in rows], do_sample=False,
                                max_new_tokens=max(row.max_tokens for row in rows), pad_token_id=pad_id, **no_stop)
    results = []
    for row, new_ids in zip(rows, output[:, width:].tolist(), strict=True):
        tokens = new_ids[:row.max_tokens]
        stop = None if row.ignore_eos else next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        results.append(Generated(tokens, "length") if stop is None else Generated(tokens[:stop + 1], "stop"))
    return results


class BatchWorker:
    """The one thread that runs the model: each `generate` takes every request waiting, up to `max_batch`."""

    def __init__(self, model: Any, tokenizer: Any, max_batch: int) -> None:
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        eos = model.generation_config.eos_token_id
        self.eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        pad = tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else min(self.eos_ids, default=0)  # masked out: any id does
        self.vocab_size: int = model.get_input_embeddings().num_embeddings
        self.max_len: int | None = getattr(model.config, "max_position_embeddings", None)
        self.batches = self.rows = 0
        self._queue: queue.Queue[tuple[Row, Future[Generated]]] = queue.Queue()
        threading.Thread(target=self._run, name="peft-batch-worker", daemon=True).start()

    async def submit(self, row: Row) -> Generated:
        future: Future[Generated] = Future()
        self._queue.put((row, future))
        return await asyncio.wrap_future(future)  # a client that goes away cancels it: its row is dropped

    def _run(self) -> None:
        while True:
            jobs = [self._queue.get()]
            while len(jobs) < self.max_batch and not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            if not (jobs := [(row, future) for row, future in jobs if future.set_running_or_notify_cancel()]):
                continue
            start = time.perf_counter()
            try:
                results = generate_batch(self.model, [row for row, _ in jobs], self.pad_id, self.eos_ids)
            except Exception as exc:  # every request of the batch is answered with it (a 500)
                logger.exception("peft-server: a batch of %d rows failed", len(jobs))
                for _, future in jobs:
                    future.set_exception(ServerError(f"generate failed on a batch of {len(jobs)} rows: {exc}"))
                continue
            self.batches, self.rows = self.batches + 1, self.rows + len(jobs)
            logger.debug("peft-server: batch of %d rows in %.1f ms", len(jobs), 1000 * (time.perf_counter() - start))
            for (_, future), result in zip(jobs, results, strict=True):
                future.set_result(result)


def _prompt_ids(worker: BatchWorker, body: CompletionRequest) -> list[int]:
    ids = body.prompt if isinstance(body.prompt, list) else worker.tokenizer(body.prompt).input_ids
    if not ids:
        raise InvalidParameter("prompt", "prompt is empty")
    if bad := [t for t in ids if not 0 <= t < worker.vocab_size]:
        raise InvalidParameter("prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {worker.vocab_size})")
    if worker.max_len is not None and len(ids) + body.max_tokens > worker.max_len:
        raise InvalidParameter("max_tokens", f"prompt has {len(ids)} tokens and max_tokens is {body.max_tokens}; "
                                             f"the context window is {worker.max_len}")
    return ids


def build_app(worker: BatchWorker, adapters: Sequence[str]) -> FastAPI:
    app = FastAPI(title="peft-server")
    fields = sorted(CompletionRequest.model_fields)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0]
        param = param_of(error["loc"])
        if error["type"] == "json_invalid":
            return _error(400, f"the body is not JSON: {error['ctx']['error']}", None, "invalid_input")
        message = (f"unsupported field {param!r}: this server takes {fields}" if error["type"] == "extra_forbidden"
                   else f"{param}: {error['msg'].removeprefix('Value error, ')}")
        return _error(400, message, param, "invalid_input")

    @app.exception_handler(LorafaasError)
    async def _refused(request: Request, exc: LorafaasError) -> JSONResponse:
        return _error(openai_status(exc.http_status), exc.message, getattr(exc, "param", None), exc.code)

    @app.get("/health", response_model=Health)
    async def health() -> Health:
        return Health(batches=worker.batches, rows=worker.rows)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name) for name in adapters])

    @app.post("/v1/completions", response_model=Completion)
    async def completions(body: CompletionRequest) -> Completion | StreamingResponse:
        if body.model not in adapters:
            raise NotFound(f"model {body.model!r} is not served here; the adapters are {list(adapters)}")
        ids = _prompt_ids(worker, body)
        generated = await worker.submit(Row(body.model, ids, body.max_tokens, body.ignore_eos))
        text = worker.tokenizer.decode(generated.token_ids, skip_special_tokens=True)
        usage = Usage(prompt_tokens=len(ids), completion_tokens=len(generated.token_ids),
                      total_tokens=len(ids) + len(generated.token_ids))
        completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def completion(choices: list[Choice], usage: Usage | None = None) -> Completion:
            return Completion(id=completion_id, created=created, model=body.model, choices=choices, usage=usage)

        choice = Choice(text=text, finish_reason=generated.finish_reason)
        if not body.stream:
            return completion([choice], usage)
        chunks = [completion([choice])]
        if body.stream_options is not None and body.stream_options.include_usage:
            chunks.append(completion([], usage))
        events = [f"data: {chunk.model_dump_json()}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")

    return app


def _error(status: int, message: str, param: str | None, code: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def load_model(model_dir: Path, adapters: dict[str, Path], device: str, dtype: str) -> tuple[Any, Any]:
    """The backbone once, wrapped by PEFT with every adapter loaded by name; eval mode."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    base = base.to(device)  # type: ignore[arg-type]  # transformers' wrapper of `to` types its first argument as the model
    (first, first_dir), *rest = adapters.items()
    model = PeftModel.from_pretrained(base, first_dir, adapter_name=first)
    for name, adapter_dir in rest:
        model.load_adapter(adapter_dir, adapter_name=name)
    return model.eval(), tokenizer


def _adapter_spec(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--adapter {spec!r}: expected NAME=ADAPTER_DIR")
    return name, Path(path)


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m lorafaas.bench.peft_server", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the backbone's Hugging Face directory")
    parser.add_argument("--adapter", type=_adapter_spec, action="append", required=True, metavar="NAME=DIR",
                        help="a PEFT LoRA adapter served as model NAME; repeat for several")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch", type=int, default=32)
    args = parser.parse_args(argv)
    adapters = dict(args.adapter)
    if len(adapters) != len(args.adapter):
        parser.error("two --adapter options share a name")
    if args.max_batch < 1:
        parser.error(f"--max-batch {args.max_batch}: give 1 or more")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, adapters, args.device, args.dtype)
    logger.info("peft-server: %s with %d adapters on %s (%s) loaded in %.1f s", args.model, len(adapters),
                args.device, args.dtype, time.perf_counter() - start)
    worker = BatchWorker(model, tokenizer, args.max_batch)
    uvicorn.run(build_app(worker, list(adapters)), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
