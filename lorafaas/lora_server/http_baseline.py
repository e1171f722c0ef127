"""A naive HTTP+JSON transport to the LoRA server: the baseline `lorafaas bench moe-transport` compares against.

What a first implementation would do: one HTTP/1.1 POST per call (keep-alive), the routed rows as nested JSON lists,
the deltas back the same way. It feeds the same batcher and compute as the shared-memory and TCP transports, so a
comparison measures the transport alone. Not for production use: it has no authentication and serializes tensors.

    POST /v1/adapters  {"adapter_id", "adapter_dir"}
    POST /v1/lora      {"adapter_id", "layer", "projection", "expert_counts", "rows": [[...], ...]} -> {"deltas"}
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

import torch

from lorafaas.errors import ClientError, LorafaasError
from lorafaas.formats.expert_adapters import ExpertAdapterInfo, ExpertLayout
from lorafaas.lora_server.compute import LoraWork

log = logging.getLogger(__name__)


class BaselineTarget(Protocol):
    """What the baseline needs of the LoRA server (`LoraServer` is one)."""

    layout: ExpertLayout
    dtype: torch.dtype

    def register(self, adapter_id: str, adapter_dir: str) -> ExpertAdapterInfo: ...

    def compute_from_thread(self, work: LoraWork) -> None: ...


def start_http_baseline(server: BaselineTarget, port: int) -> str:
    """Serve the baseline on 127.0.0.1:`port` (0: any free port) in a thread; returns its URL."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as any client library would use

        def log_message(self, format: str, *args: object) -> None:
            log.debug(format, *args)

        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self.path == "/v1/adapters":
                    info = server.register(str(body["adapter_id"]), str(body["adapter_dir"]))
                    self._reply(200, {"adapter_id": body["adapter_id"], "rank": info.rank})
                elif self.path == "/v1/lora":
                    self._reply(200, {"deltas": self._lora(body)})
                else:
                    self._reply(404, {"error": {"code": "not_found", "message": f"no route {self.path}"}})
            except (KeyError, TypeError, ValueError) as exc:
                self._reply(400, {"error": {"code": "invalid_input", "message": f"malformed request: {exc}"}})
            except LorafaasError as exc:
                status = 400 if isinstance(exc, ClientError) else 500
                self._reply(status, {"error": {"code": exc.code, "message": exc.message}})

        def _lora(self, body: dict) -> list:
            in_features, out_features = server.layout.features(body["projection"])
            rows = torch.tensor(body["rows"], dtype=server.dtype).reshape(-1, in_features)
            counts = tuple(int(c) for c in body["expert_counts"])
            if sum(counts) != rows.shape[0] or len(counts) != server.layout.num_experts:
                raise ValueError(f"expert_counts {counts} do not describe {rows.shape[0]} rows")
            work = LoraWork(
                adapter_id=str(body["adapter_id"]),
                layer=int(body["layer"]),
                projection=body["projection"],
                expert_counts=counts,
                rows=rows,
                result=torch.empty(rows.shape[0], out_features, dtype=server.dtype),
            )
            server.compute_from_thread(work)
            return work.result.tolist()

        def _reply(self, status: int, document: dict) -> None:
            payload = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="lora-http-baseline", daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}"
