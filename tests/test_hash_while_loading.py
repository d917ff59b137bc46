"""At level ``full`` a daemon hashes the shards it has not hashed before while it copies
them into the arena (``weightcache_service.hashing``): until then the model's fingerprint is
pending; a second load of the very same files is refused at once, one of the same content
from other files once the hashes are known; the digests are remembered by file identity."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import rfc8785

from tests.race_support import Racing, preload_changing, racing_daemon
from tests.recipe_support import preload
from tests.support import (
    Checkpoints,
    DaemonPool,
    RpcFailure,
    get_model,
    rpc_failure,
    service_stub,
    shm_segments,
)
from weightcache._loader import _acquire_request
from weightcache.core.checkpoint import open_checkpoint
from weightcache.core.fingerprint import Fingerprint, compute_fingerprint
from weightcache.core.hashcache import cached_sha256, fd_sha256
from weightcache.core.protocol import fingerprint_from_pb
from weightcache.core.recipe import Placement, Recipe
from weightcache.v1 import weight_cache_service_pb2 as pb

FULL = pb.FINGERPRINT_LEVEL_FULL
KNOWN_BEFORE_READING = ["format", "layout", "placement", "recipe"]


@pytest.fixture
def racing(daemons: DaemonPool, tmp_path: Path) -> Iterator[Racing]:
    with racing_daemon(daemons, tmp_path) as race:
        yield race


def _expected(model: pb.Model, folder: Path) -> Fingerprint:
    """The complete fingerprint of ``folder`` under ``model``'s recipe and placement, by
    docs/fingerprint.md: the shard components of any recipe, the others as the daemon
    reported them, digest = sha256(JCS(components))."""
    components = {c.name: c.digest for c in model.fingerprint.components}
    shards = compute_fingerprint(open_checkpoint(folder), Recipe(), Placement(), "full")
    components |= {n: d for n, d in shards.components.items() if n.startswith("checkpoint/")}
    components = dict(sorted(components.items()))
    digest = hashlib.sha256(rfc8785.dumps(components)).hexdigest()
    return Fingerprint(digest=digest, level="full", components=components)


def _acquire(socket: str, folder: Path, fp: Fingerprint) -> pb.AcquireResponse | RpcFailure:
    with service_stub(socket) as stub:
        try:
            reply: pb.AcquireResponse = stub.Acquire(_acquire_request(folder, fp, 10.0), timeout=10)
        except grpc.RpcError as exc:
            return rpc_failure(exc)
    stub_release(socket, reply.lease.lease_id)
    return reply


def stub_release(socket: str, lease_id: str) -> None:
    with service_stub(socket) as stub:
        stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=10)


def _preload_outcome(socket: str, path: Path, pause: Path) -> pb.PreloadResponse | RpcFailure:
    try:
        return preload(socket, path, plugins=[("pause", {"dir": str(pause)})], level=FULL)[-1]
    except grpc.RpcError as exc:
        return rpc_failure(exc)


def test_a_first_full_load_is_pending_until_it_has_hashed_what_it_copied(
    racing: Racing, checkpoints: Checkpoints
) -> None:
    folder = racing.root / "model"
    shutil.copytree(checkpoints.sharded, folder)
    pause = racing.base / "pause"
    socket = racing.daemon.socket
    seen: dict[str, object] = {}

    def while_loading() -> None:
        loading = get_model(socket, "model")
        seen["loading"] = loading
        seen["again"] = _preload_outcome(socket, folder, pause)
        seen["acquire"] = _acquire(socket, folder, _expected(loading, folder))

    outcome = preload_changing(socket, folder, pause, while_loading, FULL)

    loading = seen["loading"]
    assert isinstance(loading, pb.Model)
    assert loading.state == pb.MODEL_STATE_LOADING
    assert (loading.fingerprint.digest, loading.fingerprint.level) == ("", FULL)
    assert [c.name for c in loading.fingerprint.components] == KNOWN_BEFORE_READING
    again = seen["again"]
    assert isinstance(again, RpcFailure), again
    assert (again.code, again.reason) == (grpc.StatusCode.ALREADY_EXISTS, "MODEL_EXISTS")
    # A worker asking for the content it may turn out to hold waits; it is not a mismatch.
    acquire = seen["acquire"]
    assert isinstance(acquire, RpcFailure), acquire
    assert (acquire.code, acquire.reason) == (grpc.StatusCode.UNAVAILABLE, "MODEL_LOADING")

    assert isinstance(outcome, list), outcome
    assert outcome[-1].state == pb.MODEL_STATE_READY
    ready = get_model(socket, "model")
    expected = _expected(loading, folder)
    assert fingerprint_from_pb(ready.fingerprint) == expected
    granted = _acquire(socket, folder, expected)
    assert isinstance(granted, pb.AcquireResponse), granted
    assert granted.model.name == "model"


def test_the_daemon_remembers_what_it_hashed_and_does_not_hash_it_again(
    racing: Racing, checkpoints: Checkpoints
) -> None:
    folder = racing.root / "model"
    shutil.copytree(checkpoints.sharded, folder)
    socket = racing.daemon.socket
    preload(socket, folder, level=FULL)
    first = get_model(socket, "model")
    remembered = sorted(p.name for p in (racing.base / "hash-cache").iterdir())
    shards = sorted(folder.glob("*.safetensors"))
    keys = []
    for shard in shards:
        st = os.stat(shard)
        keys.append(f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}")
        digest = hashlib.sha256(shard.read_bytes()).hexdigest()
        assert (racing.base / "hash-cache" / keys[-1]).read_text() == digest
    assert remembered == sorted(keys)
    with service_stub(socket) as stub:
        stub.Evict(pb.EvictRequest(name="model"), timeout=10)
    seen: list[pb.Model] = []

    preload_changing(
        socket, folder, racing.base / "pause", lambda: seen.append(get_model(socket, "model")), FULL
    )

    # The digests came from the cache: complete before a byte was copied.
    [loading] = seen
    assert loading.state == pb.MODEL_STATE_LOADING
    assert len(loading.fingerprint.digest) == 64
    assert _shard_components(loading.fingerprint) == _shard_components(first.fingerprint)


def _shard_components(fp: pb.Fingerprint) -> dict[str, str]:
    return {c.name: c.digest for c in fp.components if c.name.startswith("checkpoint/")}


def test_the_same_content_from_other_files_is_refused_once_hashed_and_leaves_nothing(
    racing: Racing, checkpoints: Checkpoints
) -> None:
    socket = racing.daemon.socket
    shutil.copytree(checkpoints.sharded, racing.root / "model")
    shutil.copytree(checkpoints.sharded, racing.root / "copy")
    preload(socket, racing.root / "model", level=FULL)
    held = get_model(socket, "model")

    with pytest.raises(grpc.RpcError) as caught:
        preload(socket, racing.root / "copy", level=FULL)

    failure = rpc_failure(caught.value)
    assert (failure.code, failure.reason) == (grpc.StatusCode.ALREADY_EXISTS, "MODEL_EXISTS")
    assert failure.metadata["model"] == "model"
    assert "found once 'copy''s shards were hashed" in failure.message
    with service_stub(socket) as stub:
        models = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
    assert [(m.name, m.state) for m in models] == [("model", pb.MODEL_STATE_READY)]
    assert models[0].fingerprint == held.fingerprint
    assert len(shm_segments(racing.daemon.tag)) == 1  # the copy's arena is freed


def test_a_stopped_hash_raises_and_remembers_nothing(tmp_path: Path) -> None:
    shard = tmp_path / "file"
    shard.write_bytes(os.urandom(3 << 20))
    cache = tmp_path / "cache"
    stop = threading.Event()
    stop.set()
    fd = os.open(shard, os.O_RDONLY)
    try:
        with pytest.raises(InterruptedError):
            fd_sha256(fd, shard, cache, stop=stop)
        assert cached_sha256(fd, cache) is None
        digest = fd_sha256(fd, shard, cache, stop=threading.Event())
        assert digest == hashlib.sha256(shard.read_bytes()).hexdigest()
        assert cached_sha256(fd, cache) == digest
    finally:
        os.close(fd)
