"""Function workers as real processes: forked from the zygote, bound to a backbone daemon's shared segment."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lorafaas.errors import InstanceUnavailable, PromptTooLong
from lorafaas.function_runtime import messages as m
from lorafaas.models.reference import greedy_generate, load_backbone, with_adapter
from lorafaas.platform.backends.local import LocalLauncher
from lorafaas.protocols.daemon_client import DaemonClient
from lorafaas.protocols.daemon_config import DaemonPaths
from lorafaas.testing.tiny_models import save_tiny_adapter

PROMPTS = ["The quick brown fox", "Tell me about the ocean.", "Le chat dort", "Arr, matey!"]


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_dense_dir) -> Path:
    home = tmp_path_factory.mktemp("worker-home")
    launcher = LocalLauncher(home)
    launcher.store.import_dir("tiny-dense", tiny_dense_dir)
    return home


@pytest.fixture(scope="module")
def adapters(home: Path) -> dict[str, Path]:
    backbone = home / "models" / "tiny-dense"
    return {name: save_tiny_adapter(home / "adapters" / name, backbone, seed=seed, rank=4 + seed)
            for seed, name in enumerate(["alpha", "beta"], start=1)}


@pytest.fixture(scope="module")
def launcher(home: Path):
    with LocalLauncher(home) as launcher:
        yield launcher
        pids = [i.pid for i in launcher.instances]
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "close() must end every worker"
    prefix = DaemonPaths.of(home, "tiny-dense", "cpu").segment_prefix
    assert not list(Path("/dev/shm").glob(f"{prefix}*")), "close() must remove the backbone segment"


def chat(request_id: str, prompt: str, max_tokens: int = 10, **params) -> m.Generate:
    return m.Generate(request_id=request_id, messages=(m.ChatMessage("user", prompt),),
                      params=m.SamplingParams(max_tokens=max_tokens, **params))


async def collect(worker, request: m.Generate) -> tuple[list[int], str, m.Finished]:
    ids, text = [], ""
    async for event in worker.generate(request):
        if isinstance(event, m.Token):
            ids.append(event.token_id)
            text += event.text
        else:
            return ids, text, event
    raise AssertionError("no Finished event")


def reference_ids(home: Path, adapter: Path, prompt: str, max_tokens: int) -> list[int]:
    model, tokenizer = load_backbone(home / "models" / "tiny-dense")
    peft_model = with_adapter(model, adapter).merge_and_unload()
    return greedy_generate(peft_model, tokenizer, prompt, max_tokens).token_ids


def test_staged_loading_reports_each_step_and_output_equals_peft(launcher, home, adapters) -> None:
    instance = launcher.launch(launcher.spec("alpha", "tiny-dense", adapters["alpha"]))

    async def scenario():
        async with await instance.connect() as worker:
            assert worker.hello.pid == instance.pid
            done = [await worker.stage(s) for s in m.STAGES]
            stats = await worker.stats()
            ids, text, finished = await collect(worker, chat("r1", PROMPTS[0]))
            return done, stats, ids, text, finished

    done, stats, ids, text, finished = asyncio.run(scenario())
    assert [d.stage for d in done] == list(m.STAGES)
    assert done[0].seconds < 0.05, "libraries come pre-imported from the zygote"
    assert all(d.memory.rss_bytes > 0 for d in done)
    assert stats.stages == m.STAGES
    assert stats.memory.shared_bytes > 0, "the backbone is mapped from the daemon's segment"
    assert ids == reference_ids(home, adapters["alpha"], PROMPTS[0], 10)
    assert text == finished.text
    assert finished.completion_tokens == len(ids)  # a sampled EOS counts, as vLLM counts it


def test_two_functions_interleaved_equal_each_request_alone(launcher, adapters) -> None:
    alpha = launcher.launch(launcher.spec("alpha", "tiny-dense", adapters["alpha"]))
    beta = launcher.launch(launcher.spec("beta", "tiny-dense", adapters["beta"]))

    async def scenario():
        async with await alpha.connect() as a, await beta.connect() as b:
            alone = {}
            for name, worker in (("alpha", a), ("beta", b)):
                for i, prompt in enumerate(PROMPTS):
                    alone[name, prompt] = (await collect(worker, chat(f"{name}-alone-{i}", prompt)))[0]
            jobs = {
                (name, prompt): collect(worker, chat(f"{name}-{i}", prompt))
                for i, prompt in enumerate(PROMPTS) for name, worker in (("alpha", a), ("beta", b))
            }
            together = dict(zip(jobs, await asyncio.gather(*jobs.values()), strict=True))
            return alone, {key: value[0] for key, value in together.items()}

    alone, together = asyncio.run(scenario())
    assert together == alone
    assert alone["alpha", PROMPTS[0]] != alone["beta", PROMPTS[0]], "different adapters must differ"


def test_cold_start_without_staging_and_unstaging(launcher, adapters) -> None:
    instance = launcher.launch(launcher.spec("alpha", "tiny-dense", adapters["alpha"]))

    async def scenario():
        async with await instance.connect() as worker:
            cold = await collect(worker, chat("cold", PROMPTS[1]))  # nothing pre-loaded: every step runs now
            stats_cold = await worker.stats()
            await worker.unstage("adapter_drop")
            dropped = await worker.stats()
            again = await collect(worker, chat("again", PROMPTS[1]))
            await worker.unstage("backbone")
            unbound = await worker.stats()
            rebound = await collect(worker, chat("rebound", PROMPTS[1]))
            return cold, stats_cold, dropped, again, unbound, rebound

    cold, stats_cold, dropped, again, unbound, rebound = asyncio.run(scenario())
    assert set(stats_cold.stage_seconds) == {"libraries", "backbone", "adapter"}, "warm-up is optional pre-loading"
    assert "adapter" not in dropped.stages
    assert again[0] == cold[0], "reloading the adapter restores the same function"
    assert "backbone" not in unbound.stages and "warmup" not in unbound.stages
    assert rebound[0] == cold[0]


def test_streaming_cancel_and_errors(launcher, adapters) -> None:
    instance = launcher.launch(launcher.spec("alpha", "tiny-dense", adapters["alpha"]))

    async def scenario():
        async with await instance.connect() as worker:
            with pytest.raises(PromptTooLong, match="context window is 256"):
                await collect(worker, m.Generate(request_id="long", prompt="fox " * 400))
            stream = worker.generate(chat("c", PROMPTS[2], max_tokens=200))
            first = await anext(stream)
            await worker.cancel("c")
            rest = [event async for event in stream]
            after = await collect(worker, chat("after", PROMPTS[2], max_tokens=4))
            return first, rest, after

    first, rest, after = asyncio.run(scenario())
    assert isinstance(first, m.Token)
    assert isinstance(rest[-1], m.Finished) and rest[-1].finish_reason == "cancelled"
    assert len(rest) < 200
    assert after[2].finish_reason in ("length", "stop"), "the worker keeps serving after a cancel and an error"


def test_a_killed_worker_fails_its_stream_with_a_clear_error(launcher, adapters) -> None:
    instance = launcher.launch(launcher.spec("alpha", "tiny-dense", adapters["alpha"]))

    async def scenario():
        async with await instance.connect() as worker:
            stream = worker.generate(chat("k", PROMPTS[0], max_tokens=200))
            await anext(stream)
            instance.kill(9)
            with pytest.raises(InstanceUnavailable, match="went away during request k"):
                async for _ in stream:
                    pass

    asyncio.run(scenario())
    assert not instance.alive()



def test_a_worker_and_its_backbone_daemon_are_not_dumpable(launcher, adapters) -> None:
    """PR_SET_DUMPABLE 0 in both (`lorafaas.protocols.process_guard`), as each reports it: a process of the same
    uid without CAP_SYS_PTRACE cannot open their /proc/PID/fd or /proc/PID/mem (the next test shows it)."""
    worker = launcher.launch(launcher.spec("alpha", "tiny-dense", adapters["alpha"]))

    async def stats():
        async with await worker.connect() as connection:
            return await connection.stats()

    assert asyncio.run(stats()).dumpable is False
    with DaemonClient.connect(launcher.daemon_socket("tiny-dense"), client="test") as daemon:
        assert daemon.status().dumpable is False


def under_capsh(command: str, **kwargs) -> subprocess.Popen:
    """`command` as a process of this uid without CAP_SYS_PTRACE (the tests run as root, which it would bypass)."""
    return subprocess.Popen(["capsh", "--drop=cap_sys_ptrace", "--", "-c", command],
                            env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}, **kwargs)


@pytest.mark.skipif(shutil.which("capsh") is None, reason="needs capsh (libcap2-bin) to drop CAP_SYS_PTRACE")
def test_a_same_uid_process_opens_nothing_of_a_process_that_is_not_dumpable() -> None:
    """What `forbid_dumping` buys, between processes of one uid and one capability set (no CAP_SYS_PTRACE): the
    probe opens the descriptors and memory of a dumpable process, and nothing of one that called it (a worker's
    base-pass buffer, the daemon's mappings of every member's buffer)."""
    holder = ("import os, sys, time; from lorafaas.protocols.process_guard import forbid_dumping; "
              "fd = os.memfd_create('secret'); {} print(os.getpid(), flush=True); time.sleep(60)")
    targets = [under_capsh(f'{sys.executable} -c "{holder.format(call)}"', stdout=subprocess.PIPE, text=True)
               for call in ("", "forbid_dumping();")]
    try:
        pids = [int(target.stdout.readline()) for target in targets]
        probe = under_capsh(f"{sys.executable} -m lorafaas.testing.proc_probe {pids[0]} {pids[1]}",
                            stdout=subprocess.PIPE, text=True)
        out, _ = probe.communicate(timeout=60)
    finally:
        for target in targets:
            target.kill()
            target.wait()
    dumpable, guarded = (json.loads(line) for line in out.splitlines())
    assert dumpable["opened"] and dumpable["mem"]  # the same uid, dumpable: open to it
    assert guarded["opened"] == [] and not guarded["mem"]
