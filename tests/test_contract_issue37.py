"""The contract gaps of issue 37, checked against a real daemon and the words of the proto
and docs: the level of an RPC preload, transformers' style names on the wire, the order of
fingerprint components and the first shard, REVOKING on shared memory without a
deadline, and seeding RPCs refused without ``--allow-seeding``."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from tests.recipe_support import preload
from tests.support import Daemon, DaemonPool, WorkerPool, rpc_failure, service_stub
from weightcache.testing.checkpoints import wait_until_settled
from weightcache.v1 import weight_cache_service_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "protos/weightcache/v1/weight_cache_service.proto"
DOCS = ROOT / "docs"


def _words(path: Path) -> str:
    """The file's text with runs of white space (and proto comment markers) as one space."""
    return " ".join(path.read_text().replace("//", " ").split())


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for offset, name in enumerate(("plain", "revoked")):
        (root / name).mkdir()
        tensors = {"w": torch.arange(16, dtype=torch.float32).reshape(4, 4) + offset}
        save_file(tensors, str(root / name / "model.safetensors"), metadata={"format": "pt"})
    # Two shards whose __metadata__ differ; the index lists the second shard first.
    sharded = root / "sharded"
    sharded.mkdir()
    weight_map = {}
    for shard in (2, 1):
        file = f"model-0000{shard}-of-00002.safetensors"
        tensor = {f"t{shard}": torch.full((4,), float(shard))}
        save_file(tensor, str(sharded / file), metadata={"shard": str(shard)})
        weight_map[f"t{shard}"] = file
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    wait_until_settled(root)
    return root


@pytest.fixture(scope="module")
def daemon(module_daemons: DaemonPool, model_root: Path) -> Daemon:
    # --fingerprint-level layout: for the start-up models only, not for RPC preloads.
    return module_daemons.start(
        [],
        args=[
            "--allow-remote-preload",
            "--model-root",
            str(model_root),
            "--fingerprint-level",
            "layout",
        ],
    )


def test_an_rpc_preload_without_a_level_is_full_whatever_the_daemons_level(
    daemon: Daemon, model_root: Path
) -> None:
    *_, last = preload(daemon.socket, model_root / "plain")
    with service_stub(daemon.socket) as stub:
        model = stub.GetModel(pb.GetModelRequest(name="plain"), timeout=10).model

    assert last.state == pb.MODEL_STATE_READY
    assert model.fingerprint.level == pb.FINGERPRINT_LEVEL_FULL
    assert (
        "unspecified means FULL, whatever the daemon's --fingerprint-level (which applies "
        "to its start-up models only)" in _words(PROTO)
    )


def test_transformers_style_names_are_refused_on_the_wire(daemon: Daemon, model_root: Path) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        preload(daemon.socket, model_root / "plain", tp_rules=[("w", "colwise_rep")], tp_size=2)
    failure = rpc_failure(refused.value)

    assert (failure.code, failure.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_RECIPE")
    assert failure.message == "tensor-parallel rule 'w': unsupported style 'colwise_rep'"
    assert "any other style there, transformers' names included, is refused with " in (
        _words(DOCS / "fingerprint.md")
    )
    assert "any other style is INVALID_RECIPE" in _words(PROTO)


def test_components_come_in_code_point_order_and_the_first_shard_is_the_smallest_name(
    daemon: Daemon, model_root: Path
) -> None:
    preload(daemon.socket, model_root / "sharded")
    with service_stub(daemon.socket) as stub:
        model = stub.GetModel(pb.GetModelRequest(name="sharded"), timeout=10).model
    names = [c.name for c in model.fingerprint.components]

    assert names == [
        "checkpoint/model-00001-of-00002.safetensors",
        "checkpoint/model-00002-of-00002.safetensors",
        "format",
        "layout",
        "placement",
        "recipe",
    ]
    assert dict(model.metadata) == {"shard": "1"}  # the index named shard 2 first
    fingerprint_md = _words(DOCS / "fingerprint.md")
    assert "sorted by name in Unicode code point order" in fingerprint_md
    assert "the smallest file name in byte order of the UTF-8 names" in fingerprint_md


def test_revoking_on_shared_memory_has_no_deadline_as_the_proto_says(
    daemon: Daemon, model_root: Path, workers: WorkerPool
) -> None:
    preload(daemon.socket, model_root / "revoked")
    worker = workers.start()
    loaded = worker.load(model_root / "revoked", socket=daemon.socket, fallback=False)
    with service_stub(daemon.socket) as stub:
        stub.Evict(pb.EvictRequest(name="revoked", force=True), timeout=10)
        [holder] = stub.ListLeases(pb.ListLeasesRequest(model="revoked"), timeout=10).leases
    worker.close()

    assert loaded["ok"] is True
    assert holder.state == pb.LEASE_STATE_REVOKING
    assert not holder.HasField("revoke_deadline")
    proto = _words(PROTO)
    assert (
        "ACTIVE, or REVOKING: with revoke_deadline set on a GPU daemon; without it on shared "
        "memory" in proto
    )
    assert "On the wire both `Revoking` and `Detached` are `LEASE_STATE_REVOKING`" in _words(
        DOCS / "leases.md"
    )


@pytest.mark.parametrize("method", ["ReadSeedData", "EndSeed"])
def test_seeding_rpcs_are_refused_without_allow_seeding(daemon: Daemon, method: str) -> None:
    with service_stub(daemon.socket) as stub, pytest.raises(grpc.RpcError) as refused:
        if method == "ReadSeedData":
            list(stub.ReadSeedData(pb.ReadSeedDataRequest(lease_id="x", length=1), timeout=10))
        else:
            stub.EndSeed(pb.EndSeedRequest(lease_id="x"), timeout=10)
    failure = rpc_failure(refused.value)

    assert (failure.code, failure.reason) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "PERMISSION_DENIED",
    )
    assert failure.metadata == {"method": method}
    assert (
        "Without `--allow-seeding` all three are refused (`PERMISSION_DENIED`), "
        "ReadSeedData and EndSeed as well" in _words(DOCS / "seeding.md")
    )
