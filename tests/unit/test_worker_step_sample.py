"""What a worker tells its step gate of each step (function_runtime/worker.py, `WorkerServer._step`): a step that
carried a prompt's prefill, or whose pass the executor told ALONE (computed here, whole), ends unsampled, so that its
time moves neither of the gate's estimates (`PassChoice`); a plain decode step, in the pass or on its own cores, is
a sample. Stand-ins for the engine, the base-pass client and the gate's socket: the wire and the estimates are
tested over a real socket in test_step_gate_shared.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lorafaas.function_runtime.engine import StepOutput
from lorafaas.function_runtime.worker import WorkerServer


class Gate:
    member = True
    shared = True

    def __init__(self) -> None:
        self.released: list[tuple[bool, bool]] = []

    def acquire(self) -> None:
        pass

    def release(self, again: bool, sample: bool = True) -> None:
        self.released.append((again, sample))


class BasePass:
    broken = False

    def __init__(self) -> None:
        self.num_alone_passes = 0
        self.steps: list[tuple[str, bool]] = []

    def begin_step(self, shared: bool) -> None:
        self.steps.append(("begin", shared))

    def end_step(self, again: bool) -> None:
        self.steps.append(("end", again))


class Engine:
    def __init__(self, outputs: list[StepOutput], base_pass: BasePass, told_alone: bool, fails: bool = False) -> None:
        self.outputs, self.base_pass, self.told_alone, self.fails = outputs, base_pass, told_alone, fails

    def step(self) -> list[StepOutput]:
        if self.told_alone:
            self.base_pass.num_alone_passes += 1
        if self.fails:
            raise RuntimeError("a step failed")
        return self.outputs

    def has_work(self) -> bool:
        return True


def server(base_pass: BasePass, gate: Gate) -> WorkerServer:
    worker = WorkerServer.__new__(WorkerServer)  # no process, no model: `_step` reads only these two
    worker.instance = SimpleNamespace(base_pass=base_pass)
    worker._gate = gate
    return worker


DECODE = StepOutput(request_id="r1", token_id=7, text="a")
FIRST_TOKEN = StepOutput(request_id="r2", token_id=8, text="b", prefill_s=0.4, prompt_tokens=32)


@pytest.mark.parametrize(("outputs", "told_alone", "sample"), [
    ([DECODE], False, True),  # a decode step in a round: a sample of the pass
    ([DECODE, FIRST_TOKEN], False, False),  # a prompt's prefill rode along
    ([DECODE], True, False),  # the executor said ALONE: the pass ran here, behind it
])
def test_a_step_is_a_sample_only_without_a_prefill_and_without_alone(outputs, told_alone, sample) -> None:
    base_pass, gate = BasePass(), Gate()
    worker = server(base_pass, gate)
    assert worker._step(Engine(outputs, base_pass, told_alone)) == (outputs, True)
    assert gate.released == [(True, sample)]
    assert base_pass.steps == [("begin", True), ("end", True)]


def test_a_failed_step_is_no_sample_and_still_releases_its_grant() -> None:
    base_pass, gate = BasePass(), Gate()
    with pytest.raises(RuntimeError):
        server(base_pass, gate)._step(Engine([DECODE], base_pass, told_alone=False, fails=True))
    assert gate.released == [(True, False)]


def test_a_worker_outside_the_pass_samples_its_own_decode_steps() -> None:
    gate = Gate()
    gate.shared = False
    worker = server(None, gate)  # type: ignore[arg-type]
    assert worker._step(Engine([DECODE], BasePass(), told_alone=False)) == ([DECODE], False)
    assert gate.released == [(True, True)]
