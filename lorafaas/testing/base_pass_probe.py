"""An honest member of the shared base pass for live tests: a function-like process that leases the backbone from
its daemon, binds a model, joins the daemon's base pass (unless --alone) and decodes greedily, reporting its tokens,
its last logits and each step's time as one JSON line.

    python -m lorafaas.testing.base_pass_probe DAEMON_SOCKET BASE_PASS_SOCKET STEPS TOKEN... [--alone]

Each step recomputes the whole sequence (no KV cache: every step is a pass of all its rows), one thread."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch

    from lorafaas import cuda_ipc
    from lorafaas.function_runtime import base_pass
    from lorafaas.models.binding import bind_backbone
    from lorafaas.protocols.daemon_client import DaemonClient

    alone = "--alone" in argv
    args = [a for a in argv if a != "--alone"]
    daemon_socket, pass_socket, steps, ids = args[0], args[1], int(args[2]), [int(t) for t in args[3:]]
    torch.set_num_threads(1)
    daemon = DaemonClient.connect(Path(daemon_socket), client="base-pass-probe")
    attached = daemon.attach("base-pass-probe")
    if attached.segment_fd is None:
        raise SystemExit("the daemon sent no segment descriptor")
    attachment = cuda_ipc.attach(attached.manifest, attached.segment_fd)
    model = bind_backbone(attachment, Path(attached.backbone.model_dir))
    client = None if alone else base_pass.install(model, attachment.tensors, pass_socket, max_rows=64)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()  # start together
    step_s, logits = [], None
    with torch.no_grad():
        for step in range(steps):
            started = time.monotonic()
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
            if client is not None:
                client.end_step(again=step < steps - 1)
            step_s.append(time.monotonic() - started)
    if logits is None:
        raise SystemExit("give at least one step")
    print(json.dumps({"tokens": ids, "logits": logits.tolist(), "step_s": step_s,
                      "broken": bool(client and client.broken),
                      "calls": client.num_calls if client else 0}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
