"""`lorafaas deploy -f FLEET` and `POST /v1/functions:batch` against a real platform (`lorafaas up`, tiny backbone):
many functions per request, each deployed on its own; a bad entry is refused with its name and field, the others
land, and nothing stored before is lost (docs/platform.md, "Functions"). Also the control plane at a thousand
functions: all listed, /metrics served."""

import json
from pathlib import Path

import httpx
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.api_client import ApiClient
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.synthetic_adapters import write_random_adapter

BACKBONE = "tiny-dense"


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir):
    home = tmp_path_factory.mktemp("batch-home")
    ModelStore(home / "models").import_dir(BACKBONE, tiny_dense_dir)
    with PlatformProcess(home) as running:
        yield running


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory, platform) -> Path:
    """Eight small distinct adapters, `fn-0` .. `fn-7`, each naming tiny-dense as its base model."""
    root = tmp_path_factory.mktemp("fleet-adapters")
    store = ModelStore(platform.home / "models")
    for seed in range(8):
        write_random_adapter(root / f"fn-{seed}", store, BACKBONE, rank=4, target_modules=("q_proj", "v_proj"),
                             seed=seed)
    return root


@pytest.fixture
def admin(platform) -> ApiClient:
    with platform.client() as client:
        yield client
        for function in client.list():
            client.delete(function.name)


@pytest.fixture
def lorafaas(platform, cli):
    def run(*args: str, timeout: float = 300):
        return cli("--home", str(platform.home), *args, env={"LORAFAAS_URL": platform.url}, timeout=timeout)
    return run


def test_a_fleet_file_deploys_every_good_entry_and_refuses_a_bad_one_in_the_middle(tmp_path, admin, adapter_root,
                                                                                   lorafaas) -> None:
    kept = admin.deploy({"name": "kept", "backbone": BACKBONE, "slo_ttft_ms": 700}, adapter_root / "fn-7")
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        f"- {{name: one, adapter: {adapter_root / 'fn-1'}, backbone: {BACKBONE}, keep-alive: 5}}\n"
        f"- {{name: two, adapter: {adapter_root / 'fn-2'}, backbone: {BACKBONE}, slo-ttft-ms: 0}}\n"  # out of bounds
        f"- {{name: kept, adapter: {adapter_root / 'fn-3'}, backbone: {BACKBONE}}}\n"  # the name is taken
        f"- {{name: four, adapter: {adapter_root / 'fn-4'}, backbone: {BACKBONE}}}\n"
        f"- {{name: five, adapter: {adapter_root / 'fn-5'}, backbone: {BACKBONE}, min: 0}}\n")
    done = lorafaas("deploy", "-f", str(fleet), "--batch-size", "2", "--json")  # three requests
    assert done.returncode == 2, done.stderr
    result = json.loads(done.stdout)
    assert [spec["name"] for spec in result["deployed"]] == ["one", "four", "five"]
    assert [(e["index"], e["name"], e["field"], e["code"]) for e in result["refused"]] == [
        (1, "two", "slo_ttft_ms", "invalid_input"), (2, "kept", "name", "already_exists")]
    listed = {spec.name: spec for spec in admin.list()}
    assert set(listed) == {"one", "four", "five", "kept"}
    assert listed["one"].keep_alive_s == 5
    assert listed["kept"].adapter_digest == kept["adapter_digest"] and listed["kept"].version == 1  # not replaced
    assert listed["kept"].slo_ttft_ms == 700


def test_the_cli_names_each_refused_entry_and_its_field(tmp_path, admin, adapter_root, lorafaas) -> None:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps([
        {"name": "good", "adapter": str(adapter_root / "fn-1"), "backbone": BACKBONE},
        {"name": "Bad_Name", "adapter": str(adapter_root / "fn-2"), "backbone": BACKBONE},
        {"name": "nowhere", "adapter": str(adapter_root / "fn-3"), "backbone": "no-such-backbone"},
        {"name": "no-files", "adapter": str(tmp_path), "backbone": BACKBONE},
    ]))
    done = lorafaas("deploy", "-f", str(fleet))
    assert done.returncode == 2
    text = " ".join(done.stderr.split())
    assert "deployed 1 of 4 functions" in text
    assert "entry 1 Bad_Name (name)" in text
    assert "entry 2 nowhere (backbone)" in text
    assert "entry 3 no-files (adapter)" in text
    assert [spec.name for spec in admin.list()] == ["good"]


def test_a_directory_of_adapters_is_a_function_per_subdirectory(tmp_path, admin, adapter_root, lorafaas) -> None:
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    for name in ("fn-1", "fn-2", "fn-3"):
        (fleet / name).symlink_to(adapter_root / name)
    broken = fleet / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapter_root / "fn-4" / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    done = lorafaas("deploy", "-f", str(fleet), "--keep-alive", "7", "--json")  # the backbone from each config
    assert done.returncode == 2, done.stderr
    result = json.loads(done.stdout)
    assert [(e["name"], e["field"]) for e in result["refused"]] == [("broken", "adapter")]
    listed = {spec.name: spec for spec in admin.list()}
    assert set(listed) == {"fn-1", "fn-2", "fn-3"}
    assert {spec.backbone for spec in listed.values()} == {BACKBONE}
    assert {spec.keep_alive_s for spec in listed.values()} == {7}  # the flag applies to every function


def test_a_batch_request_is_checked_whole_before_any_entry(platform, admin, adapter_root) -> None:
    headers = {"Authorization": f"Bearer {platform.admin_key}"}
    archive = ApiClient.pack(adapter_root / "fn-1")

    def post(specs: str, count: int) -> httpx.Response:
        files = [("adapters", (f"a{i}.tar.gz", archive, "application/gzip")) for i in range(count)]
        return httpx.post(f"{platform.url}/v1/functions:batch", data={"specs": specs}, files=files, headers=headers,
                          timeout=60)

    one = json.dumps([{"name": "x1", "backbone": BACKBONE}])
    for specs, count in [(one, 2), ("{}", 1), ("not json", 1), ("[]", 1)]:
        reply = post(specs, count)
        assert 400 <= reply.status_code < 500, (specs, reply.text)
        assert reply.status_code == 422 and reply.json()["error"]["code"] == "invalid_input", reply.text
    too_many = json.dumps([{"name": f"x{i}", "backbone": BACKBONE} for i in range(501)])
    assert post(too_many, 1).status_code == 422
    not_a_spec = post(json.dumps([1]), 1)  # an entry of the list: refused alone
    assert not_a_spec.status_code == 200 and not_a_spec.json()["refused"][0]["code"] == "invalid_input"
    assert admin.list() == []
    no_key = httpx.post(f"{platform.url}/v1/functions:batch", data={"specs": one},
                        files=[("adapters", ("a.tar.gz", archive, "application/gzip"))], timeout=60)
    assert no_key.status_code == 401


def test_a_tenant_deploys_a_fleet_for_itself_only(platform, admin, adapter_root) -> None:
    key = admin.create_key("acme")["key"]
    with ApiClient(platform.url, key) as acme:
        result = acme.deploy_many([{"name": "mine", "backbone": BACKBONE},
                                   {"name": "theirs", "backbone": BACKBONE, "tenant": "other"}],
                                  [ApiClient.pack(adapter_root / "fn-1"), ApiClient.pack(adapter_root / "fn-2")])
        assert [spec["tenant"] for spec in result["deployed"]] == ["acme"]
        assert [(e["name"], e["field"], e["code"]) for e in result["refused"]] == [("theirs", "tenant", "forbidden")]
        assert [spec.name for spec in acme.list()] == ["mine"]


def test_a_thousand_functions_are_listed_and_scraped(tmp_path, tiny_dense_dir, cli) -> None:
    """The control plane at 1,000 functions: every one deployed and listed, /metrics served (its size and time are
    `lorafaas bench control-plane`'s). A platform of its own, stopped whole: no thousand deletes after it."""
    store = ModelStore(tmp_path / "home" / "models")
    store.import_dir(BACKBONE, tiny_dense_dir)
    fleet = tmp_path / "fleet"
    for index in range(1000):
        write_random_adapter(fleet / f"f{index:04d}", store, BACKBONE, rank=4, target_modules=("q_proj",),
                             seed=index)
    with PlatformProcess(tmp_path / "home") as platform:
        env = {"LORAFAAS_URL": platform.url}
        done = cli("--home", str(platform.home), "deploy", "-f", str(fleet), "--batch-size", "250", env=env,
                   timeout=900)
        assert done.returncode == 0, done.stderr
        listed = json.loads(cli("--home", str(platform.home), "list", "--json", env=env).stdout)
        assert sorted(spec["name"] for spec in listed) == sorted(p.name for p in fleet.iterdir())
        assert len({spec["adapter_digest"] for spec in listed}) == 1000
        scrape = httpx.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {platform.admin_key}"})
        assert scrape.status_code == 200 and "lorafaas_busy_instances" in scrape.text
