"""What a worker written from the proto and the docs alone needs (issue 27, items 10, 15,
16, 17), checked against a real daemon: the default level as the proto states it, the
plugin versions the fingerprint holds, a bounded ``__metadata__`` echo, and the rules the
docs now state (digest alone, ``tp_size`` 0, the trusted uid, reflection v1)."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
import rfc8785
import torch
from grpc_reflection.v1alpha import reflection_pb2
from safetensors.torch import save_file

from tests.recipe_support import PLUGINS, preload
from tests.support import Daemon, DaemonPool, WorkerPool, assert_attached
from weightcache._trust import ENV_TRUSTED_UID
from weightcache.core.fingerprint import DEFAULT_LEVEL
from weightcache.core.protocol import MAX_METADATA_BYTES
from weightcache.core.rpc import target
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "protos/weightcache/v1/weight_cache_service.proto"
PROTOCOL_MD = ROOT / "docs/protocol.md"
BIG_METADATA = {"format": "pt", "notes": "x" * (MAX_METADATA_BYTES + 1)}


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for name, metadata in (("big-metadata", BIG_METADATA), ("plain", {"format": "pt"})):
        (root / name).mkdir()
        tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
        save_file(tensors, str(root / name / "model.safetensors"), metadata=metadata)
    return root


@pytest.fixture(scope="module")
def daemon(module_daemons: DaemonPool, model_root: Path) -> Daemon:
    path = os.environ.get("PYTHONPATH")
    return module_daemons.start(
        [],
        args=[
            "--allow-remote-preload",
            "--model-root",
            str(model_root),
            "--allow-recipe",
            "drop_tensors",
        ],
        env={"PYTHONPATH": str(PLUGINS) + (os.pathsep + path if path else "")},
    )


def _model(socket: str, name: str) -> pb.Model:
    with grpc.insecure_channel(target(socket)) as channel:
        stub = pb_grpc.WeightCacheServiceStub(channel)
        model: pb.Model = stub.GetModel(pb.GetModelRequest(name=name), timeout=10).model
        return model


def _evict(socket: str, name: str) -> None:
    with grpc.insecure_channel(target(socket)) as channel:
        pb_grpc.WeightCacheServiceStub(channel).Evict(pb.EvictRequest(name=name), timeout=10)


def test_a_preload_without_a_level_is_full_as_the_proto_says(
    daemon: Daemon, model_root: Path
) -> None:
    text = PROTO.read_text()
    # The proto's comments as one line of prose: whatever --fingerprint-level says (it
    # applies to the start-up models only).
    prose = " ".join(line.strip().removeprefix("//").strip() for line in text.splitlines())
    assert f"unspecified means {DEFAULT_LEVEL.upper()}, whatever the daemon's" in prose
    assert "unspecified means SAMPLED" not in text

    done = preload(daemon.socket, model_root / "plain")[-1]
    try:
        model = _model(daemon.socket, done.model)
        assert model.fingerprint.level == pb.FINGERPRINT_LEVEL_FULL
    finally:
        _evict(daemon.socket, done.model)


def test_the_recipe_component_can_be_computed_from_the_wire_alone(
    daemon: Daemon, model_root: Path
) -> None:
    """A worker without the plugin's code: the Model message gives the version, and the
    recipe component (docs/fingerprint.md, "Recipe") follows from it."""
    done = preload(
        daemon.socket, model_root / "plain", plugins=[("drop_tensors", {"pattern": "nothing*"})]
    )[-1]
    try:
        model = _model(daemon.socket, done.model)
        [plugin] = model.recipe.plugins
        assert (plugin.name, plugin.version, dict(plugin.params)) == (
            "drop_tensors",
            "0.1",
            {"pattern": "nothing*"},
        )
        value: Any = {
            "name": "weightcache.recipe",
            "version": 2,
            "dtype": model.recipe.dtype or None,
            "tp_plan": None,
            "plugins": [
                {
                    "name": p.name,
                    "version": p.version,
                    "params": [[k, p.params[k]] for k in sorted(p.params)],
                }
                for p in model.recipe.plugins
            ],
        }
        components = {c.name: c.digest for c in model.fingerprint.components}
        assert hashlib.sha256(rfc8785.dumps(value)).hexdigest() == components["recipe"]
    finally:
        _evict(daemon.socket, done.model)


def test_huge_metadata_is_not_echoed_and_a_worker_reads_it_from_the_header(
    daemon: Daemon, model_root: Path, workers: WorkerPool
) -> None:
    big = preload(daemon.socket, model_root / "big-metadata")[-1].model
    plain = preload(daemon.socket, model_root / "plain")[-1].model
    try:
        with grpc.insecure_channel(target(daemon.socket)) as channel:
            stub = pb_grpc.WeightCacheServiceStub(channel)
            listed = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
        assert f"at most {MAX_METADATA_BYTES} bytes in UTF-8" in PROTO.read_text()
        assert (dict(listed[big].metadata), listed[big].metadata_omitted) == ({}, True)
        assert (dict(listed[plain].metadata), listed[plain].metadata_omitted) == (
            {"format": "pt"},
            False,
        )

        worker = workers.start()
        reply = worker.load(model_root / "big-metadata", socket=daemon.socket)
        worker.close()  # its lease ends: the model may be evicted

        assert_attached(reply)
        assert reply["metadata"] == BIG_METADATA
    finally:
        _evict(daemon.socket, big)
        _evict(daemon.socket, plain)


def test_the_daemon_grants_on_the_digest_alone_and_reads_tp_size_0_as_1(
    daemon: Daemon, model_root: Path
) -> None:
    done = preload(daemon.socket, model_root / "plain", tp_size=0)[-1]
    try:
        model = _model(daemon.socket, done.model)
        components = {c.name: c.digest for c in model.fingerprint.components}
        one_rank = rfc8785.dumps({"tp_rank": 0, "tp_size": 1})
        assert components["placement"] == hashlib.sha256(one_rank).hexdigest()
        bogus = [pb.FingerprintComponent(name="recipe", digest="0" * 64)]
        request = pb.AcquireRequest(
            request_id=uuid.uuid4().hex,
            fingerprint=pb.Fingerprint(
                digest=model.fingerprint.digest, level=model.fingerprint.level, components=bogus
            ),
            checkpoint_path="/nowhere",
            pid=os.getpid(),
        )
        with grpc.insecure_channel(target(daemon.socket)) as channel:
            stub = pb_grpc.WeightCacheServiceStub(channel)
            granted = stub.Acquire(request, timeout=10)
            stub.Release(pb.ReleaseRequest(lease_id=granted.lease.lease_id), timeout=10)
        assert granted.model.name == done.model
    finally:
        _evict(daemon.socket, done.model)


def test_reflection_is_served_as_v1_too(daemon: Daemon) -> None:
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    services = {}
    with grpc.insecure_channel(target(daemon.socket)) as channel:
        for package in ("v1", "v1alpha"):
            # v1's messages are v1alpha's, field for field: one stub's codecs serve both.
            call = channel.stream_stream(
                f"/grpc.reflection.{package}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            (reply,) = list(call(iter([ask]), timeout=10))
            services[package] = sorted(s.name for s in reply.list_services_response.service)

    assert (
        services["v1"]
        == services["v1alpha"]
        == [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
            "weightcache.v1.WeightCacheService",
        ]
    )


def test_protocol_md_states_what_a_worker_in_another_language_needs() -> None:
    text = " ".join(PROTOCOL_MD.read_text().split())
    for needed in (
        f"`${ENV_TRUSTED_UID}`",
        "It grants on the digest alone",
        "`Placement.tp_size` 0 (unset) means 1 everywhere",
        "`Model.recipe.plugins[].version`",
        "at the level the daemon used for the model: `Model.fingerprint.level` in `ListModels`",
        "For a copy of the checkpoint at another path",
        "`grpc.reflection.v1` and `grpc.reflection.v1alpha`",
        "`core.protocol.MAX_METADATA_BYTES`",
    ):
        assert needed in text, needed
