"""The shared base pass (`lorafaas.backbone_daemon.base_pass`, `lorafaas.function_runtime.base_pass`) on a tiny seeded
backbone in a real sealed segment, over real Unix sockets and memfd buffers: members (one model each, bound to the
segment, with its own adapter and its own prompt) computing together give what each computes alone; a stranger, a
member of another model and a member breaking the protocol are refused; a member that stalls holds nobody up."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lorafaas import cuda_ipc
from lorafaas.backbone_daemon.base_pass import BasePassExecutor, packs_bf16
from lorafaas.backbone_daemon.loader import load_into_segment
from lorafaas.formats.model_store import ModelStore
from lorafaas.function_runtime import base_pass as client
from lorafaas.models.base_pass_groups import backbone_groups
from lorafaas.models.binding import bind_backbone
from lorafaas.models.lora import attach_adapter, detach_adapter, read_host_adapter
from lorafaas.protocols import base_pass as bp
from lorafaas.testing.base_pass_member import RawMember
from lorafaas.testing.tiny_models import save_tiny_adapter
from lorafaas.wire import encode_frame


@pytest.fixture(scope="module")
def segment(tiny_store: ModelStore):
    manifest = tiny_store.get("tiny-dense")
    export = load_into_segment(tiny_store.path("tiny-dense"), manifest.weight_files, "cpu", f"bp-test-{os.getpid()}")
    yield export, tiny_store.path("tiny-dense")
    export.destroy()


@pytest.fixture()
def executor(segment, tmp_path: Path):
    export, _ = segment
    attachment = cuda_ipc.attach(export.manifest, export.fd)
    allowed = {"pids": {os.getpid()}}
    running = BasePassExecutor(tmp_path / "bp.sock", attachment.tensors, tuple(groups_of(segment)),
                               lambda pid: pid in allowed["pids"],
                               threads=1, hold_s=0.5, deadline_s=0.2)
    running.allowed = allowed
    running.start()
    yield running
    running.stop()
    attachment.close()


def bound_model(segment, adapter_dir: Path | None = None):
    export, model_dir = segment
    attachment = cuda_ipc.attach(export.manifest, export.fd)
    model = bind_backbone(attachment, model_dir)
    if adapter_dir is not None:
        attach_adapter(model, read_host_adapter(adapter_dir))
    return model, attachment


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_store: ModelStore) -> list[Path]:
    """Three adapters whose factors are drawn here, with torch.randn: PEFT's random init goes through torch.nn.init,
    which transformers' no_init_weights patches process-wide (and leaves patched if two threads overlap in it).
    They wrap a layer of the MLP (down_proj): their members compute the MLP themselves."""
    return _random_adapters(tmp_path_factory, tiny_store, "bp-adapters", (1, 2, 3),
                            ("q_proj", "v_proj", "o_proj", "down_proj"))


@pytest.fixture(scope="module")
def attention_adapters(tmp_path_factory, tiny_store: ModelStore) -> list[Path]:
    """Two adapters of the attention only (the demo adapters' kind): their members' MLPs go to the executor whole."""
    return _random_adapters(tmp_path_factory, tiny_store, "bp-attention-adapters", (4, 5),
                            ("q_proj", "k_proj", "v_proj", "o_proj"))


def _random_adapters(tmp_path_factory, tiny_store: ModelStore, name: str, seeds: tuple[int, ...],
                     targets: tuple[str, ...]) -> list[Path]:
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp(name)
    made = []
    for seed in seeds:
        path = save_tiny_adapter(out / f"a{seed}", tiny_store.path("tiny-dense"), seed=seed, target_modules=targets)
        generator = torch.Generator().manual_seed(seed)
        tensors = {name: torch.randn(t.shape, generator=generator) * 0.05
                   for name, t in load_file(path / "adapter_model.safetensors").items()}
        save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
        made.append(path)
    return made


@pytest.mark.parametrize("mix", ["mlp adapters", "mixed"])
def test_members_computing_together_get_what_each_computes_alone(segment, executor, adapters, attention_adapters,
                                                                 mix: str) -> None:
    """"mixed": two members whose MLPs the executor computes whole beside one computing its own (its adapter wraps
    down_proj): the round stays in step (nobody straggles) and every member gets what it computes alone."""
    adapters_with_mlp = set(adapters)
    if mix == "mixed":
        adapters = [attention_adapters[0], adapters[0], attention_adapters[1]]
    prompts = [torch.tensor([[1, 5, 9, 13, 17, 21, 3, 7]]), torch.tensor([[2, 4, 6, 8]]),
               torch.tensor([[11, 12, 13, 14, 15, 16]])]
    expected = []
    for adapter, ids in zip(adapters, prompts, strict=True):
        model, _ = bound_model(segment, adapter)
        with torch.no_grad():
            expected.append(model(ids).logits)
    got: list[torch.Tensor | None] = [None] * 3
    members = []
    for adapter in adapters:  # built here, one after another: transformers' no_init_weights is not thread-safe
        model, attachment = bound_model(segment)
        c = client.install(model, attachment.tensors, str(executor.path), max_rows=4)  # prompts go in chunks
        attach_adapter(model, read_host_adapter(adapter))  # an adapter attached after joining wraps as before
        members.append((model, c))
    barrier = threading.Barrier(3)

    def member(i: int) -> None:
        model, c = members[i]
        barrier.wait()
        with torch.no_grad():
            for step in range(4):
                got[i] = model(prompts[i]).logits
                c.end_step(again=step < 3)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for mine, alone in zip(got, expected, strict=True):
        assert mine is not None
        torch.testing.assert_close(mine, alone, rtol=1e-5, atol=1e-5)  # batched products: rounding may differ
    assert executor.stats.rounds >= 1
    assert executor.stats.batched_products > 0  # the rows of two or more members in one product
    assert sum(c.num_calls for _, c in members) > 0
    assert executor.stats.stragglers == 0
    wraps_mlp = [adapter in adapters_with_mlp for adapter in adapters]
    assert [c.num_skips > 0 for _, c in members] == wraps_mlp  # an MLP with the adapter's delta: computed here


def test_a_gated_mlp_is_one_group_of_the_pass(segment) -> None:
    model, attachment = bound_model(segment)
    groups = client.layer_groups(model, attachment.tensors)
    num_layers = model.config.num_hidden_layers
    mlps = [spec for spec, _ in groups if spec.mlp_down]
    assert len(mlps) == num_layers  # gate, up and down in one call: three calls a decoder layer, not four
    assert all(spec.weights[0].endswith("mlp.gate_proj.weight") and spec.weights[1].endswith("mlp.up_proj.weight")
               and spec.mlp_down.endswith("mlp.down_proj.weight") for spec in mlps)
    assert len(groups) == 3 * num_layers + 1  # q/k/v, o, the MLP; the LM head


def test_a_call_with_no_rows_keeps_a_place_only_at_a_gated_mlp(segment, executor) -> None:
    groups = groups_of(segment)
    mlp = next(key for key, spec in enumerate(groups) if spec.mlp_down)
    members = [RawMember(str(executor.path), groups) for _ in range(2)]
    assert all(member.welcome().accepted for member in members)
    in_round(executor, members, [torch.zeros(1, executor.weights.in_width(0))] * 2)
    for key in range(1, mlp):
        for member in members:
            member.send_call(key, 1)
        assert [member.reply() for member in members] == [bp.DONE, bp.DONE]
    members[0].send_call(mlp, 0)
    members[1].send_call(mlp, 1)
    assert [member.reply() for member in members] == [bp.DONE, bp.DONE]  # nothing computed for 0 rows: kept its place
    members[0].send_call(mlp + 1, 0)
    assert members[0].reply() == b""  # 0 rows anywhere else is a bad call
    for member in members:
        member.close()


def test_one_member_alone_computes_its_pass_itself(segment, executor) -> None:
    model, attachment = bound_model(segment)
    c = client.install(model, attachment.tensors, str(executor.path))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        out = model(ids).logits
    c.end_step(again=False)
    client.uninstall(model)
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids).logits, rtol=0, atol=0)  # computed here: bit for bit
    assert c.num_alone_passes == 1 and executor.stats.rounds == 0


def test_a_step_granted_cores_runs_here_and_no_round_waits_for_its_member(segment, executor) -> None:
    model, attachment = bound_model(segment)
    c = client.install(model, attachment.tensors, str(executor.path))
    ids = torch.tensor([[2, 7, 1, 8]])
    with torch.no_grad():
        c.begin_step(shared=True)  # the step gate said: the shared pass
        model(ids)
        c.end_step(again=True)  # another step follows: a round's start would wait for this member
        member = wait_until(lambda: next((executor.policy._members[m.id] for m in executor._members.values()
                                          if executor.policy._members[m.id].active), None))
        calls = c.num_calls + c.num_alone_passes
        c.begin_step(shared=False)  # the next step was granted cores of its own
        out = model(ids).logits
        c.end_step(again=True)
    assert c.num_calls + c.num_alone_passes == calls  # nothing went to the executor
    wait_until(lambda: not member.active)  # and it was told not to wait for this member
    client.uninstall(model)
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids).logits, rtol=0, atol=0)  # computed here: bit for bit


@pytest.mark.parametrize("shared", [True, False])
def test_no_layer_group_keeps_its_tensors_after_the_pass(segment, executor, shared: bool) -> None:
    """A group's input and outputs are dropped once its last layer took its output: kept, a prefill's activations
    of every layer would stay alive between steps (it was about 100 MB a member on SmolLM2)."""
    model, attachment = bound_model(segment)
    c = client.install(model, attachment.tensors, str(executor.path))
    forwards = [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), client.RemoteForward)]
    assert forwards
    with torch.no_grad():
        c.begin_step(shared=shared)
        model(torch.tensor([[4, 8, 15, 16, 23, 42]]))
        c.end_step(again=False)
    held = [f.layer for f in forwards if any(isinstance(t, (torch.Tensor, list)) for t in f._shared)]
    assert held == []


def wait_until(probe, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := probe():
            return value
        time.sleep(0.01)
    raise AssertionError("the executor never got there")


def test_a_process_without_a_lease_is_refused(segment, executor) -> None:
    executor.allowed["pids"] = set()
    model, attachment = bound_model(segment)
    with pytest.raises(client.BasePassUnavailable, match=r"cannot be reached|refused"):
        client.install(model, attachment.tensors, str(executor.path))
    assert executor.stats.refused == 1


def test_an_unanswered_lease_check_refuses_and_the_executor_serves_on(segment, executor) -> None:
    def lease_table_gone(pid: int) -> bool:
        raise TimeoutError("the daemon's loop did not answer")

    executor.may_join = lease_table_gone
    model, attachment = bound_model(segment)
    with pytest.raises(client.BasePassUnavailable):
        client.install(model, attachment.tensors, str(executor.path))
    executor.may_join = lambda pid: True
    c = client.install(model, attachment.tensors, str(executor.path))  # the executor's thread is still serving
    assert not c.broken and executor.stats.refused == 1


def mapped_files(label: str) -> list[str]:
    """/proc/self/map_files entries of the mappings of memfds labelled `label`."""
    with open("/proc/self/maps") as maps:
        return [f"/proc/self/map_files/{line.split()[0]}" for line in maps if f"/memfd:{label} " in line]


def descriptors_of(label: str, pid: int | str = "self") -> list[str]:
    """This process's descriptors of memfds labelled `label` (as root, any process's)."""
    found = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith(f"/memfd:{label} "):
                found.append(name)
    return found


def test_a_members_buffer_cannot_be_shrunk_or_grown_under_the_executor(segment, executor) -> None:
    model, attachment = bound_model(segment)
    client.install(model, attachment.tensors, str(executor.path))
    [path] = mapped_files("lorafaas-base-pass")[:1]
    fd = os.open(path, os.O_RDWR)  # root may reopen a mapping's file; a member holds its buffer like this
    try:
        for size in (4096, 1 << 31):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    finally:
        os.close(fd)


def test_no_descriptor_of_a_members_buffer_is_kept_once_mapped(segment, executor) -> None:
    """The executor (here, in this process) and the member each keep their mapping of the buffer, not its
    descriptor: /proc/<daemon>/fd and /proc/<worker>/fd hold nothing another process could reopen it by."""
    model, attachment = bound_model(segment)
    c = client.install(model, attachment.tensors, str(executor.path))
    wait_until(lambda: executor._members and all(m.greeted for m in executor._members.values()))
    assert descriptors_of("lorafaas-base-pass") == []
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # and the pass still works from the mappings
    assert c.num_alone_passes == 1 and not c.broken


def raw_member(executor, groups, max_rows: int = 4, dtype: str = "float32", size: int | None = None,
               sealed: bool = True):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(executor.path))
    fd = os.memfd_create("test-member", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size if size is not None else 64 << 20)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    socket.send_fds(sock, [encode_frame(bp.BasePassHello(groups=tuple(groups), max_rows=max_rows, dtype=dtype))],
                    [fd])
    os.close(fd)
    return sock


def read_welcome(sock: socket.socket) -> bp.BasePassWelcome:
    import msgspec

    data = b""
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return msgspec.msgpack.decode(data[4:], type=bp.BasePassWelcome)


def groups_of(segment) -> list[bp.GroupSpec]:
    """The groups a real member of this backbone sends (and the daemon derives)."""
    model, attachment = bound_model(segment)
    return list(backbone_groups(model, attachment.tensors))


@pytest.mark.parametrize(("change", "why"), [
    ({"groups": [bp.GroupSpec(weights=("no.such.weight",), biases=(None,))]}, "not the backbone's"),
    ({"dtype": "bfloat16"}, "float32"),
    ({"max_rows": 0}, "max_rows"),
    ({"size": 4096}, "buffer must hold"),
    ({"sealed": False}, "F_SEAL_SHRINK"),  # shrunk under the executor's mapping, it would fault the daemon
])
def test_a_hello_the_backbone_does_not_fit_is_refused(segment, executor, change: dict, why: str) -> None:
    args = {"groups": groups_of(segment), **change}
    sock = raw_member(executor, **args)
    welcome = read_welcome(sock)
    assert not welcome.accepted and why in welcome.message
    assert sock.recv(1) == b""  # and hung up on


def test_a_hello_whose_groups_are_not_the_backbones_is_refused_alone_even_first(segment, tmp_path: Path) -> None:
    """The groups are the daemon's, derived from the backbone: a bogus first hello (one group of the backbone's
    real weights) is refused and decides nothing; honest members join after it, and while it is connected. (Every
    member here is this process: the ban a refused hello earns its process is off, `ban_s` 0.)"""
    export, _ = segment
    attachment = cuda_ipc.attach(export.manifest, export.fd)
    executor = BasePassExecutor(tmp_path / "bp.sock", attachment.tensors, tuple(groups_of(segment)),
                                lambda pid: pid == os.getpid(), threads=1, hold_s=0.5, deadline_s=0.2,
                                round_config={"ban_s": 0.0})
    executor.start()
    try:
        _bogus_first(segment, executor)
    finally:
        executor.stop()
        attachment.close()


def _bogus_first(segment, executor) -> None:
    bogus = RawMember(str(executor.path), groups_of(segment)[:1])
    welcome = bogus.welcome()
    assert not welcome.accepted and "groups" in welcome.message
    honest = RawMember(str(executor.path), groups_of(segment))
    assert honest.welcome().accepted
    other = RawMember(str(executor.path), groups_of(segment)[1:])  # another model's, or a forged one
    assert not other.welcome().accepted
    assert RawMember(str(executor.path), groups_of(segment)).welcome().accepted
    assert executor.stats.refused == 2
    bogus.close()
    honest.close()
    other.close()


def test_a_process_whose_hello_was_refused_is_closed_at_accept_for_a_while(segment, executor) -> None:
    """Looping bad hellos costs the executor thread only an accept: no lease check, no decode, no map."""
    bogus = RawMember(str(executor.path), groups_of(segment)[:1])
    assert not bogus.welcome().accepted
    bogus.close()
    again = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    again.settimeout(10)
    again.connect(str(executor.path))
    assert again.recv(1) == b""  # closed at accept, before a byte of a hello is read
    again.close()
    assert executor.stats.refused == 2


@pytest.mark.parametrize("call", [(10_000, 1, 0), (0, 5, 0), (0, 0, 0), (0, -1, 0)])
def test_a_call_out_of_bounds_is_hung_up_on(segment, executor, call: tuple[int, int, int]) -> None:
    sock = raw_member(executor, groups_of(segment), max_rows=4)
    assert read_welcome(sock).accepted
    sock.sendall(bp.HEADER.pack(*call))
    assert sock.recv(1) == b""  # no reply, the connection closed: nothing computed outside its buffer


def test_a_member_that_stalls_in_a_round_holds_nobody_up(segment, executor) -> None:
    model, attachment = bound_model(segment)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        alone = model(ids).logits
    c = client.install(model, attachment.tensors, str(executor.path), max_rows=8)
    staller = raw_member(executor, groups_of(segment), max_rows=8)
    assert read_welcome(staller).accepted
    with torch.no_grad():
        passes = [model(ids).logits]  # alone: nobody else active
        c.end_step(again=True)  # the member is active: a pass start now waits for it
        staller.sendall(bp.HEADER.pack(0, 3, 0))  # a pass start, held for the member; then never a call again
        passes.append(model(ids).logits)  # a round of two; the staller drops out at the deadline
        c.end_step(again=True)
        passes.append(model(ids).logits)  # the staller sits out: not waited for, the member computes alone
        c.end_step(again=False)
    assert staller.recv(1) == bp.DONE  # its first group was computed in the round
    for out in passes:
        torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)
    assert executor.stats.rounds == 1 and executor.stats.stragglers == 1
    assert c.num_alone_passes == 2
    staller.close()


def test_a_member_whose_executor_goes_away_computes_alone(segment, executor) -> None:
    model, attachment = bound_model(segment)
    ids = torch.tensor([[7, 8, 9]])
    with torch.no_grad():
        alone = model(ids).logits
    c = client.install(model, attachment.tensors, str(executor.path))
    executor.stop()
    with torch.no_grad():
        out = model(ids).logits
    assert c.broken
    torch.testing.assert_close(out, alone, rtol=0, atol=0)


@pytest.fixture(scope="module")
def bf16_segment(tmp_path_factory, tiny_dense_dir: Path):
    """The tiny backbone's bf16 copy (`backbone convert`), in a sealed segment."""
    from lorafaas.formats.backbone_dtype import convert_backbone

    store = ModelStore(tmp_path_factory.mktemp("bf16-home") / "models")
    store.import_dir("tiny-dense", tiny_dense_dir)
    manifest, _ = convert_backbone(store, "tiny-bf16", "tiny-dense", "bfloat16")
    export = load_into_segment(store.path("tiny-bf16"), manifest.weight_files, "cpu", f"bp-bf16-{os.getpid()}")
    yield export, store.path("tiny-bf16")
    export.destroy()


@pytest.mark.skipif(not packs_bf16(), reason="oneDNN has no native bf16 on this CPU: nothing is packed")
def test_a_bf16_backbone_is_computed_from_packed_weights_bit_for_bit(bf16_segment, tmp_path: Path) -> None:
    """The executor computes a bf16 backbone from a packed copy of its weights (oneDNN's layout), on one thread; a
    member's outputs are what F.linear gives from the segment's own weights, bit for bit, whatever the rows."""
    export, _ = bf16_segment
    attachment = cuda_ipc.attach(export.manifest, export.fd)
    running = BasePassExecutor(tmp_path / "bp.sock", attachment.tensors, tuple(groups_of(bf16_segment)),
                               lambda pid: pid == os.getpid(), threads=2)
    running.start()
    try:
        model, member_attachment = bound_model(bf16_segment)
        groups = client.layer_groups(model, member_attachment.tensors)
        c = client.install(model, member_attachment.tensors, str(running.path), max_rows=8)
        assert wait_until(lambda: running.packed)
        weights = attachment.tensors
        generator = torch.Generator().manual_seed(0)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the plain products' reference, as the executor's thread computes
        partner = RawMember(str(running.path), groups_of(bf16_segment), dtype="bfloat16")  # a round of two
        assert partner.welcome().accepted
        partner.write(torch.zeros(1, groups[0][1][0].in_features, dtype=torch.bfloat16))
        try:
            for rows in (1, 3, 8):
                c.end_step(again=True)
                partner.end(again=True)
                partner.send_call(0, 1)  # held for the member
                assert c.call(0, torch.zeros(rows, groups[0][1][0].in_features, dtype=torch.bfloat16)) is not None
                assert partner.reply() == bp.DONE
                for key in (1, 2, 3):  # o_proj, the gated MLP, the next layer's q/k/v
                    spec, layers = groups[key]
                    x = torch.randn(rows, layers[0].in_features, generator=generator).to(torch.bfloat16)
                    partner.write(torch.zeros(1, layers[0].in_features, dtype=torch.bfloat16))
                    partner.send_call(key, 1)
                    got = c.call(key, x)
                    assert partner.reply() == bp.DONE
                    both = torch.cat([x, torch.zeros(1, x.shape[1], dtype=x.dtype)])  # the round's rows, in order
                    if spec.mlp_down:
                        gate, up = (weights[name] for name in spec.weights)
                        expected = [F.linear(F.silu(F.linear(both, gate)) * F.linear(both, up),
                                             weights[spec.mlp_down])[:rows]]
                    else:
                        expected = [F.linear(both, weights[name])[:rows] for name in spec.weights]
                    assert got is not None and len(got) == len(expected)
                    for mine, plain in zip(got, expected, strict=True):
                        assert torch.equal(mine, plain), (key, rows)
        finally:
            torch.set_num_threads(threads)
            partner.close()
        c.close()
        wait_until(lambda: not running.packed)  # the last member left: the private copy goes with it
        assert not running._members
    finally:
        running.stop()
        attachment.close()


@pytest.mark.skipif(not packs_bf16(), reason="oneDNN has no native bf16 on this CPU: nothing is packed")
def test_a_refused_hello_makes_no_packed_copy(bf16_segment, tmp_path: Path) -> None:
    """The copy is made once a first member is accepted: a hello the backbone does not fit (here, the wrong dtype)
    costs the executor no copy and no packing time."""
    export, _ = bf16_segment
    attachment = cuda_ipc.attach(export.manifest, export.fd)
    running = BasePassExecutor(tmp_path / "bp.sock", attachment.tensors, tuple(groups_of(bf16_segment)),
                               lambda pid: pid == os.getpid(), threads=2,
                               round_config={"ban_s": 0.0})  # both hellos are this process's
    running.start()
    try:
        packings = []
        running._pack_if_bf16 = lambda: packings.append(True)  # counts calls; nothing is packed
        welcome = read_welcome(raw_member(running, groups_of(bf16_segment), dtype="float32"))
        assert not welcome.accepted and "bfloat16" in welcome.message
        assert packings == [] and not running.packed
        assert read_welcome(raw_member(running, groups_of(bf16_segment), dtype="bfloat16")).accepted
        assert packings == [True]
    finally:
        running.stop()
        attachment.close()


def test_a_llamas_decoder_layers_each_get_a_layer_tail(segment) -> None:
    """After the groups, one tail a decoder layer: its o_proj, MLP and norms, ending with the next layer's q/k/v
    products (the LM head's after the last)."""
    model, attachment = bound_model(segment)
    groups = client.layer_groups(model, attachment.tensors)
    tails = client.layer_tails(model, attachment.tensors, groups)
    num_layers = model.config.num_hidden_layers
    assert len(tails) == num_layers
    for index, (spec, key) in enumerate(tails):
        assert spec.tail.o_proj == f"model.layers.{index}.self_attn.o_proj.weight"
        assert spec.tail.down == f"model.layers.{index}.mlp.down_proj.weight"
        following = "model.norm.weight" if index == num_layers - 1 else \
            f"model.layers.{index + 1}.input_layernorm.weight"
        assert spec.tail.next_norm == following
        assert spec.weights == groups[key][0].weights
    assert tails[-1][1] == len(groups) - 1  # the LM head (its weight may be the embedding's, tied)


def greedy_decode(model, prompt: list[int], steps: int, before=lambda step: None,
                  after=lambda step: None, base_pass=None) -> list[torch.Tensor]:
    """Prefill `prompt`, then `steps` greedy tokens with `decode_step` (in `base_pass`, the model's client): the
    logits of each step. `before(step)` and `after(step)` run around each step; the prefill is step -1."""
    from lorafaas.function_runtime.decode_step import decode_step
    from lorafaas.function_runtime.engine import CACHE_FIELD

    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    got = []
    with torch.inference_mode():
        before(-1)
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        after(-1)
        cache, token = getattr(out, CACHE_FIELD), out.logits[:, -1].argmax(-1)
        for step in range(steps):
            before(step)
            mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=1)
            logits = decode_step(model, token[:, None], mask, torch.tensor([[len(prompt) + step]]), cache,
                                 base_pass=base_pass)
            after(step)
            got.append(logits)
            token = logits[:, -1].argmax(-1)
    return got


def decode_members(segment, executor, adapters: list[Path], prompts: list[list[int]], steps: int,
                   tails: bool = True):
    """Each adapter's member prefills its prompt and decodes `steps` greedy tokens, all in the pass at once (one
    thread each); returns each member's logits of every step and its client."""
    members = []
    for adapter in adapters:
        model, attachment = bound_model(segment)
        c = client.install(model, attachment.tensors, str(executor.path))
        if not tails:
            c.tails = None
        attach_adapter(model, read_host_adapter(adapter))
        c.end_step(again=True)  # active from the start: every step a round, none decided by a hold running out
        members.append((model, c))
    got: list[list[torch.Tensor]] = [[] for _ in adapters]
    barrier = threading.Barrier(len(adapters))

    def member(i: int) -> None:
        model, c = members[i]
        # every member at each step's start: the same rounds in every run
        got[i] = greedy_decode(model, prompts[i], steps, before=lambda step: barrier.wait(),
                               after=lambda step: c.end_step(again=step < steps - 1), base_pass=c)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(adapters))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return got, [c for _, c in members]


def decode_alone(segment, adapter: Path, prompt: list[int], steps: int) -> list[torch.Tensor]:
    model, _ = bound_model(segment, adapter)
    return greedy_decode(model, prompt, steps)


PROMPTS = [[1, 5, 9, 13, 17, 21, 3, 7], [2, 4, 6, 8], [11, 12, 13, 14, 15, 16]]


def test_decode_steps_through_the_layer_tails_get_what_each_member_computes_alone(segment, executor, adapters,
                                                                                 attention_adapters) -> None:
    """Two members whose adapters wrap q, k, v and o_proj decode through the layer tails (one call a layer), their
    o_proj deltas sent with the attention's output; a third, whose adapter wraps down_proj, cannot (its MLP has the
    delta): it computes its passes itself while the two go on together. Every member gets what it computes alone."""
    chosen = [attention_adapters[0], adapters[0], attention_adapters[1]]
    steps = 4
    got, clients = decode_members(segment, executor, chosen, PROMPTS, steps)
    for adapter, prompt, mine in zip(chosen, PROMPTS, got, strict=True):
        assert len(mine) == steps
        for step, (logits, alone) in enumerate(zip(mine, decode_alone(segment, adapter, prompt, steps), strict=True)):
            torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    assert [c.num_fused_passes for c in clients] == [steps, 0, steps]
    assert executor.stats.fused_rounds == steps and executor.stats.stragglers == 0
    num_layers = len(clients[0].tails.keys)
    layer_calls = executor.stats.round_calls  # per member per group: each fused pass is 1 + layers calls
    assert layer_calls >= 2 * steps * (1 + num_layers)


def test_the_layer_tails_compute_what_the_pass_computes_group_by_group_bit_for_bit(segment, executor,
                                                                                  attention_adapters) -> None:
    """The same two members, the same rounds: through the tails (the residual adds, norms and MLP in the executor)
    and group by group (them here), the logits are equal bit for bit."""
    steps = 3
    fused, fused_clients = decode_members(segment, executor, attention_adapters, PROMPTS[:2], steps)
    plain, plain_clients = decode_members(segment, executor, attention_adapters, PROMPTS[:2], steps, tails=False)
    assert [c.num_fused_passes for c in fused_clients] == [steps, steps]
    assert [c.num_fused_passes for c in plain_clients] == [0, 0]
    for mine, theirs in zip(fused, plain, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b), (a - b).abs().max()


def test_float32_adapters_on_a_bf16_backbone_go_through_the_layer_tails_bit_for_bit(bf16_segment, tmp_path: Path,
                                                                                      attention_adapters) -> None:
    """Adapters saved in float32 (PEFT's default) on a bf16 backbone: their o_proj deltas travel in float32, so the
    tails add them as PEFT does (the float32 sum rounded once) and decode steps go through the tails, with logits
    equal bit for bit to the same rounds group by group, where each member adds its own delta."""
    export, _ = bf16_segment
    attachment = cuda_ipc.attach(export.manifest, export.fd)
    running = BasePassExecutor(tmp_path / "bp.sock", attachment.tensors, tuple(groups_of(bf16_segment)),
                               lambda pid: pid == os.getpid(), threads=1, hold_s=0.5, deadline_s=0.2)
    running.start()
    try:
        steps = 3
        fused, fused_clients = decode_members(bf16_segment, running, attention_adapters, PROMPTS[:2], steps)
        plain, plain_clients = decode_members(bf16_segment, running, attention_adapters, PROMPTS[:2], steps,
                                              tails=False)
    finally:
        running.stop()
        attachment.close()
    assert [c.num_fused_passes for c in fused_clients] == [steps, steps]  # none before: the deltas were float32
    assert [c.num_fused_passes for c in plain_clients] == [0, 0]
    for mine, theirs in zip(fused, plain, strict=True):
        assert len(mine) == steps
        for a, b in zip(mine, theirs, strict=True):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b), (a.float() - b.float()).abs().max()


def test_a_fused_start_is_refused_where_a_backbone_has_no_tails(segment, tmp_path: Path) -> None:
    model, attachment = bound_model(segment)
    groups = tuple(spec for spec, _ in client.layer_groups(model, attachment.tensors))  # a backbone without tails
    running = BasePassExecutor(tmp_path / "bp.sock", attachment.tensors, groups, lambda pid: True, threads=1)
    running.start()
    try:
        sock = raw_member(running, groups, max_rows=4)
        assert read_welcome(sock).accepted
        sock.sendall(bp.HEADER.pack(0, 1, bp.FUSED))
        assert sock.recv(1) == b""  # hung up on: no tails to go through
    finally:
        running.stop()


def test_the_layer_tails_are_checked_again_when_another_adapter_is_attached(segment, executor, adapters,
                                                                             attention_adapters) -> None:
    """Whether a decode step can go through the tails is kept between steps, until an adapter is attached or
    detached: one that wraps down_proj (its delta in the MLP) turns them off after steps that used them."""
    model, attachment = bound_model(segment)
    c = client.install(model, attachment.tensors, str(executor.path))
    attach_adapter(model, read_host_adapter(attention_adapters[0]))
    assert c.tails.usable(model) and c.tails.usable(model)  # the second from what the first found
    attach_adapter(model, read_host_adapter(adapters[0]))
    assert not c.tails.usable(model)
    detach_adapter(model)  # its wrapper stays on down_proj: the MLP is computed here, as `RemoteMLP` does
    assert not c.tails.usable(model)


def in_round(executor, members: list[RawMember], xs: list[torch.Tensor]) -> None:
    """Two raw members ready for a round: each has said another step follows, then each starts a pass with its X;
    returns once both got their first group (DONE)."""
    for member in members:
        member.end(again=True)
    for member, x in zip(members, xs, strict=True):
        member.write(x)
        member.send_call(0, x.shape[0])
    assert [member.reply() for member in members] == [bp.DONE, bp.DONE]


def group_outputs(executor, key: int, x: torch.Tensor) -> list[torch.Tensor]:
    return [F.linear(x, weight, bias) for weight, bias in executor.weights.layer(key)]


def read_outputs(executor, member: RawMember, key: int, rows: int, max_rows: int = 4) -> list[torch.Tensor]:
    max_in = max(executor.weights.in_width(k) for k in range(executor.weights.num_groups))
    offset, outs = max_rows * max_in, []
    for weight, _ in executor.weights.layer(key):
        outs.append(member.read(offset, rows, weight.shape[0]))
        offset += rows * weight.shape[0]
    return outs


def test_a_hello_that_fails_to_map_refuses_only_its_sender_and_the_round_goes_on(segment, executor) -> None:
    """A buffer sealed against writes cannot be mapped writable (PermissionError): only that hello is refused, its
    sender is forgotten, and the members of the round in progress get their outputs as before."""
    groups = groups_of(segment)
    honest = [RawMember(str(executor.path), groups) for _ in range(2)]
    assert all(member.welcome().accepted for member in honest)
    width = executor.weights.in_width(0)
    xs = [torch.randn(2, width, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    in_round(executor, honest, xs)
    hostile = RawMember(str(executor.path), groups, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    welcome = hostile.welcome()
    assert not welcome.accepted and "write" in welcome.message
    assert hostile.reply() == b""  # hung up on
    wait_until(lambda: len(executor._members) == 2)  # the half-greeted sender is not kept
    width = executor.weights.in_width(1)
    xs = [torch.randn(2, width, generator=torch.Generator().manual_seed(seed)) for seed in (3, 4)]
    for member, x in zip(honest, xs, strict=True):
        member.write(x)
        member.send_call(1, 2)
    assert [member.reply() for member in honest] == [bp.DONE, bp.DONE]  # the round went on
    for member, x in zip(honest, xs, strict=True):
        for got, want in zip(read_outputs(executor, member, 1, 2), group_outputs(executor, 1, x), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert executor.stats.rounds == 1 and executor.stats.refused == 1
    for member in [*honest, hostile]:
        member.close()



def test_an_idle_active_member_is_waited_for_once_then_sits_out(segment, executor) -> None:
    """A member that says another step follows (END with AGAIN) and never starts a pass is waited for at one pass
    start only: then it is no longer awaited (until it starts a pass), so later pass starts are not held for it."""
    groups = groups_of(segment)
    honest, idle = RawMember(str(executor.path), groups), RawMember(str(executor.path), groups)
    assert honest.welcome().accepted and idle.welcome().accepted
    idle.end(again=True)
    for _ in range(4):
        honest.end(again=True)
        assert honest.call(0, 1) == bp.ALONE  # nobody else starts: it computes its pass itself
    assert executor.stats.holds_expired == 1  # one pass start waited hold_s for it; the next three did not
    idle.end(again=True)  # saying so again does not make it awaited again
    honest.end(again=True)
    assert honest.call(0, 1) == bp.ALONE
    assert executor.stats.holds_expired == 1
    honest.close()
    idle.close()
