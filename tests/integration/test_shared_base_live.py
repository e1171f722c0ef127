"""The shared base pass as a user runs it: three functions on one backbone, a burst of greedy requests to all of them
at once. With the pass taken from two functions stepping at once (`--shared-base-from 2`), the workers send the
backbone's linear layers to the backbone daemon's base pass, which computes rows of several functions together; with
the default `lorafaas up` (no flags), the step gate tries the pass as soon as several members step at once and keeps
whichever measures faster. Every reply equals the one the same platform without the pass (`--no-shared-base`) gives."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

FUNCTIONS = ("alpha", "beta", "gamma")
PROMPTS = ("Tell me a story about the sea.", "What is two and two?", "Name three colours.")


def burst_replies(home: Path, models_dir: Path, adapters: dict[str, Path], extra_args: tuple[str, ...],
                  own_pass: tuple[str, ...] = ()) -> tuple[dict[tuple[str, str], str], PlatformProcess, dict]:
    """The burst's replies, the platform, and what it counted: gated steps by kind, and per function whether its
    instances were started in the shared base pass. `own_pass`: functions deployed with shared_base false."""
    store = ModelStore(home / "models")
    store.import_dir("tiny-dense", models_dir)
    with PlatformProcess(home, extra_args=extra_args) as platform, platform.client() as admin:
        for name in FUNCTIONS:
            admin.deploy({"name": name, "backbone": "tiny-dense"} | ({"shared_base": False} if name in own_pass
                                                                      else {}), adapters[name])

        async def burst():
            async with httpx.AsyncClient(base_url=platform.url, timeout=300,
                                         headers={"Authorization": f"Bearer {platform.admin_key}"}) as http:
                for name in FUNCTIONS:  # each function's instance up first: the burst is served warm, together
                    (await http.post(f"/v1/functions/{name}/invoke", json={"prompt": "hi", "max_tokens": 1})
                     ).raise_for_status()
                keys = [(name, prompt) for name in FUNCTIONS for prompt in PROMPTS]
                replies = await asyncio.gather(*(
                    http.post(f"/v1/functions/{name}/invoke",
                              json={"prompt": prompt, "max_tokens": 24, "temperature": 0})
                    for name, prompt in keys))
                return keys, replies

        keys, replies = asyncio.run(burst())
        assert [r.status_code for r in replies] == [200] * len(replies), [r.text for r in replies]
        texts = {key: reply.json()["text"] for key, reply in zip(keys, replies, strict=True)}
        described = {name: admin.describe(name) for name in FUNCTIONS}
        members = {name: {i["shared_base"] for i in d["instances"]} for name, d in described.items()}
        learned = {name: d["batching"]["prefills_observed"] for name, d in described.items()}
        return texts, platform, {"steps": gated_steps(platform), "members": members, "learned": learned}


def gated_steps(platform: PlatformProcess) -> dict[str, float]:
    text = httpx.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {platform.admin_key}"}).text
    return {s.labels["kind"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "lorafaas_gated_steps_total"}


def test_a_burst_over_three_functions_through_the_shared_base_pass_gives_their_own_replies(
        tmp_path: Path, tiny_dense_dir: Path) -> None:
    adapters = {name: save_tiny_adapter(tmp_path / f"adapter-{name}", tiny_dense_dir, seed=seed,
                                        base_model_name="tiny-dense")
                for seed, name in enumerate(FUNCTIONS, start=1)}
    slots = ("--compute-slots", "2")
    shared, platform, shared_seen = burst_replies(tmp_path / "shared", tiny_dense_dir, adapters,
                                                  (*slots, "--shared-base", "--shared-base-from", "2"),
                                                  own_pass=("gamma",))
    default, _, default_seen = burst_replies(tmp_path / "default", tiny_dense_dir, adapters, slots)
    alone, _, alone_seen = burst_replies(tmp_path / "alone", tiny_dense_dir, adapters, (*slots, "--no-shared-base"))
    assert shared == alone and default == alone
    assert len({shared[(name, PROMPTS[0])] for name in FUNCTIONS}) == 3  # each function's own adapter answered
    # the step gate sent the members into the pass: from two stepping at once, and by default, to measure it
    assert shared_seen["steps"]["shared"] > 0
    assert default_seen["steps"]["shared"] > 0 and default_seen["steps"]["granted"] > default_seen["steps"]["shared"]
    assert alone_seen["steps"]["shared"] == 0
    # a function deployed with shared_base false is never a member; the others are, where the node runs the pass
    assert shared_seen["members"] == {"alpha": {True}, "beta": {True}, "gamma": {False}}
    assert default_seen["members"] == {name: {True} for name in FUNCTIONS}
    assert alone_seen["members"] == {name: {False} for name in FUNCTIONS}
    # a prefill in the pass took the round's time, not its function's: the batching model did not learn from it
    in_pass = ("alpha", "beta")
    assert sum(shared_seen["learned"][n] for n in in_pass) < sum(alone_seen["learned"][n] for n in in_pass)

    daemon_log = platform.home / "logs" / "daemon-tiny-dense.log"
    deadline = time.monotonic() + 30  # the executor logs its counts every 10 s while they change
    rounds = fused = 0
    while time.monotonic() < deadline and not (rounds and fused):
        text = daemon_log.read_text() if daemon_log.exists() else ""
        counts = re.findall(r"base pass: (?:stopped with )?\d+ member\(s\); BasePassStats\(rounds=(\d+), "
                            r"round_calls=\d+, batched_products=(\d+).*fused_rounds=(\d+)", text)
        rounds = max((int(r) for r, products, _ in counts if int(products) > 0), default=0)
        fused = max((int(f) for _, _, f in counts), default=0)
        time.sleep(1)
    assert rounds > 0, "the base pass never computed two functions' rows together"
    assert fused > 0, "no decode step went through the layer tails"  # the adapters wrap q and v only
