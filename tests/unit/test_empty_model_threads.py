"""`build_empty_model` from several threads at once (the gateway validates concurrent uploads on worker threads):
transformers' no_init_weights swaps torch.nn.init's functions process-wide, so two threads overlapping in it used to
leave the no-ops in place, and every later random init in the process (a PEFT adapter's, a test's) left its
tensors uninitialised."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from lorafaas.models.binding import build_empty_model

REAL_INITS = {name: getattr(torch.nn.init, name) for name in ("kaiming_uniform_", "normal_", "uniform_", "zeros_")}


def test_empty_models_built_at_once_leave_torch_init_as_it_was(tiny_dense_dir: Path) -> None:
    for _round in range(5):
        barrier = threading.Barrier(4)

        def build(barrier: threading.Barrier) -> None:
            barrier.wait()
            build_empty_model(tiny_dense_dir)

        threads = [threading.Thread(target=build, args=(barrier,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert {name: getattr(torch.nn.init, name) for name in REAL_INITS} == REAL_INITS
    layer = torch.nn.Linear(64, 64)  # and a fresh layer is initialised
    assert torch.isfinite(layer.weight).all() and layer.weight.abs().max() <= 1 / 8 + 1e-6
