"""The pool of pre-forked worker processes (platform/backends/standby_pool.py, function_runtime/standby.py): a new
function's instance starts from a pool process, and a process serves one function for its whole life. Functions are
deployed, invoked, deleted and redeployed (under new names and under a name used before) one after another; every
instance pid and every pool pid is watched. Checked: instances did start from the pool; the pids that served each
deployment are disjoint from every other deployment's; a pool process, once it served a function, is never in the
pool again; each answer is its own adapter's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess, processes_naming, wait_for
from lorafaas.testing.tiny_models import save_tiny_adapter

REQUEST = {"messages": [{"role": "user", "content": "Tell me about the ocean."}], "max_tokens": 8}
# (name, adapter seed): a name comes back with another adapter, which is another deployment
DEPLOYMENTS = (("f1", 1), ("f2", 2), ("f1", 3), ("f3", 4), ("f2", 5), ("f4", 6))


def standby_pids(home: Path) -> set[int]:
    """Processes listening on a pool socket (run/standby-*.sock): the pool's members now."""
    paths = {str(p) for p in (home / "run").glob("standby-*.sock")}
    inodes = set()
    with open("/proc/net/unix") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7] in paths:
                inodes.add(f"socket:[{fields[6]}]")
    found = set()
    for pid in processes_naming(home):
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if links & inodes:
            found.add(pid)
    return found


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_dense_dir) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("pool-adapters")
    return {seed: save_tiny_adapter(root / f"a{seed}", tiny_dense_dir, seed=seed, base_model_name="tiny-dense")
            for _, seed in DEPLOYMENTS}


def test_a_process_serves_one_function_for_its_whole_life(tmp_path, tiny_dense_dir, adapters) -> None:
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    served: dict[str, set[int]] = {}  # deployment uid -> pids of its instances
    pool_seen: set[int] = set()  # every pid ever seen in the pool
    assigned: set[int] = set()  # pool pids seen serving a function
    back_in_pool: set[int] = set()
    stop = threading.Event()
    with PlatformProcess(tmp_path, extra_args=("--standby-workers", "1")) as platform, platform.client() as admin:
        answers = {}
        current: dict[str, str] = {}  # name -> uid of its live deployment

        def watch() -> None:  # every pid that serves a deployment, and the pool's members, sampled often
            while not stop.is_set():
                pool = standby_pids(tmp_path)
                back_in_pool.update(pool & assigned)
                pool_seen.update(pool)
                for name, uid in list(current.items()):
                    try:
                        instances = admin.describe(name)["instances"]
                    except Exception:  # deleted meanwhile
                        continue
                    pids = {i["pid"] for i in instances if i["pid"] and i["deployment"] == uid}
                    served.setdefault(uid, set()).update(pids)
                    assigned.update(pids & pool_seen)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            for k, (name, seed) in enumerate(DEPLOYMENTS):
                if k:  # the pool fills once its backbone is resident: from the first deployment on
                    wait_for(lambda: standby_pids(tmp_path), 60, "a pool process ready")
                deployed = admin.deploy({"name": name, "backbone": "tiny-dense", "keep_alive_s": 30}, adapters[seed])
                current[name] = deployed["uid"]
                answer = admin.invoke(name, REQUEST)["text"]
                answers[seed] = answer
                described = admin.describe(name)
                served.setdefault(deployed["uid"], set()).update(i["pid"] for i in described["instances"])
                admin.delete(name)
                del current[name]
        finally:
            stop.set()
            watcher.join(30)
        for pids in served.values():  # the pool pids each deployment was served by count as assigned
            assigned.update(pids & pool_seen)
    assert len(set(answers.values())) == len(DEPLOYMENTS), f"each adapter answers its own way: {answers}"
    assert assigned, f"no instance started from the pool (pool pids {sorted(pool_seen)}, served {served})"
    uids = list(served)
    for k, uid in enumerate(uids):
        for other in uids[k + 1:]:
            assert not served[uid] & served[other], f"pids {served[uid] & served[other]} served two deployments"
    assert not back_in_pool, f"pool processes {sorted(back_in_pool)} were back in the pool after serving"
    assert processes_naming(tmp_path) == {}, "no process left"
