"""A function pod's adapter fetch against a real platform: the controller's internal route serves each adapter by
digest to the holder of that function's token only, and the fetch keeps nothing whose bytes do not hash to the digest.

On Kubernetes this is how a pod on any node gets its adapter (tests/integration/k8s/test_k8s_helm_e2e.py runs it
there); here the platform is a real `lorafaas up` process and the fetch the pods' init step, as a process too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.function_runtime.adapter_fetch import AdapterFetchError, fetch_adapter
from lorafaas.platform.adapter_access import AdapterAccess
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir):
    home = tmp_path_factory.mktemp("fetch-home")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(home) as running:
        yield running


@pytest.fixture(scope="module")
def deployed(platform, tmp_path_factory, tiny_dense_dir) -> dict[str, tuple[str, Path]]:
    """function -> (its adapter's digest, the adapter's source directory); two functions, two adapters."""
    out = {}
    with platform.client() as admin:
        for seed, name in enumerate(("alpha", "beta")):
            source = save_tiny_adapter(tmp_path_factory.mktemp(name), tiny_dense_dir, base_model_name="tiny-dense",
                                       seed=seed + 1)
            out[name] = (admin.deploy({"name": name, "backbone": "tiny-dense"}, source)["adapter_digest"], source)
    assert out["alpha"][0] != out["beta"][0]
    return out


def tokens(platform) -> AdapterAccess:
    return AdapterAccess.from_admin_key(platform.admin_key)  # the controller derives its key the same way


def get(platform, digest: str, file: str, token: str, function: str) -> httpx.Response:
    return httpx.get(f"{platform.url}/internal/adapters/{digest}/{file}",
                     headers={"authorization": f"Bearer {token}", "x-lorafaas-function": function})


def test_a_pods_token_fetches_its_own_adapter_byte_for_byte(platform, deployed, tmp_path: Path) -> None:
    digest, source = deployed["alpha"]
    dest = fetch_adapter(platform.url, "alpha", digest, tokens(platform).token("alpha", digest), tmp_path / "a")
    for name in (CONFIG, WEIGHTS):
        assert (dest / name).read_bytes() == (source / name).read_bytes()


def test_another_functions_adapter_is_refused_with_403(platform, deployed, tmp_path: Path) -> None:
    alpha, _ = deployed["alpha"]
    beta, _ = deployed["beta"]
    own = tokens(platform).token("alpha", alpha)
    assert get(platform, beta, WEIGHTS, own, "alpha").status_code == 403  # alpha's token, beta's digest
    assert get(platform, alpha, WEIGHTS, own, "beta").status_code == 403  # alpha's token, posing as beta
    assert get(platform, alpha, WEIGHTS, own, "alpha").status_code == 200
    with pytest.raises(AdapterFetchError, match="403"):
        fetch_adapter(platform.url, "alpha", beta, own, tmp_path / "b")
    assert not any((tmp_path / "b").iterdir())


def test_api_keys_open_no_adapter_not_even_the_admins_or_the_owners(platform, deployed) -> None:
    digest, _ = deployed["alpha"]
    with platform.client() as admin:
        tenant_key = admin.create_key("acme")["key"]
    with platform.client(tenant_key) as tenant:
        tenant_digest = tenant.deploy({"name": "own", "backbone": "tiny-dense"}, deployed["alpha"][1])["adapter_digest"]
    for key, function, wanted in ((platform.admin_key, "alpha", digest), (tenant_key, "alpha", digest),
                                  (tenant_key, "own", tenant_digest)):
        reply = get(platform, wanted, WEIGHTS, key, function)
        assert reply.status_code == 403, reply.text
        assert reply.json()["error"]["code"] == "forbidden"


def test_bad_digests_and_files_are_4xx_never_500(platform, deployed) -> None:
    digest, _ = deployed["alpha"]
    access = tokens(platform)
    assert get(platform, "not-a-digest", WEIGHTS, access.token("alpha", "not-a-digest"), "alpha").status_code == 422
    assert get(platform, digest, "secrets.txt", access.token("alpha", digest), "alpha").status_code == 404
    gone = "0" * 64
    assert get(platform, gone, WEIGHTS, access.token("alpha", gone), "alpha").status_code == 404


def test_a_damaged_adapter_is_refused_on_arrival_and_nothing_is_kept(platform, tmp_path, tiny_dense_dir) -> None:
    source = save_tiny_adapter(tmp_path / "src", tiny_dense_dir, base_model_name="tiny-dense", seed=7)
    with platform.client() as admin:
        digest = admin.deploy({"name": "damaged", "backbone": "tiny-dense"}, source)["adapter_digest"]
    stored = platform.home / "adapters" / digest / WEIGHTS
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF  # the controller's copy rots on its disk
    stored.write_bytes(bytes(data))
    env = {**os.environ, "LORAFAAS_ADAPTER_URL": platform.url, "LORAFAAS_FUNCTION": "damaged",
           "LORAFAAS_ADAPTER_DIGEST": digest, "LORAFAAS_ADAPTER_TOKEN": tokens(platform).token("damaged", digest)}
    dest = tmp_path / "pod-volume"
    done = subprocess.run([sys.executable, "-m", "lorafaas.function_runtime.adapter_fetch", str(dest)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"not to the deployed digest {digest[:12]}" in done.stderr
    assert not any(dest.iterdir())  # nothing a worker could load
