"""Attach by file identity: a worker whose checkpoint files are the very files the daemon
loaded gets the model without reading them; any other gets it by fingerprint, or the same
fallback as before."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

import grpc
import pytest
from safetensors.torch import load_file

import weightcache
from tests.support import (
    SHARD_2,
    Checkpoints,
    Daemon,
    DaemonPool,
    WorkerPool,
    assert_attached,
    assert_bitwise_equal,
    rpc_failure,
    service_stub,
)
from weightcache.core.checkpoint import INDEX_FILE, FileIdentity, file_identities, open_checkpoint
from weightcache.core.fingerprint import (
    DEFAULT_LEVEL,
    REQUEST_COMPONENTS,
    Fingerprint,
    Level,
    compute_fingerprint,
    request_components,
)
from weightcache.core.protocol import (
    acquire_request_pb,
    fingerprint_from_pb,
    grant_from_pb,
)
from weightcache.core.recipe import Placement, Recipe
from weightcache.core.records import Acquisition, Environment, TensorFormat
from weightcache.v1 import weight_cache_service_pb2 as pb

_ACQUIRED = re.compile(r"acquired\b.*\bmatch=(\w+)")


@pytest.fixture
def copied(checkpoints: Checkpoints, tmp_path: Path) -> Path:
    """A private copy of ``sharded``, which a test may change."""
    folder = tmp_path / "sharded"
    shutil.copytree(checkpoints.sharded, folder)
    return folder


@pytest.fixture
def holder(daemons: DaemonPool, copied: Path) -> Daemon:
    """A daemon holding ``copied`` as stored."""
    return daemons.start([copied])


def _by_files(
    folder: Path,
    *,
    recipe: Recipe | None = None,
    level: Level = DEFAULT_LEVEL,
    files: dict[str, FileIdentity] | None = None,
    tensor_format: TensorFormat = "table",
) -> pb.AcquireRequest:
    """The Acquire by file identity that ``weightcache.load(folder)`` sends."""
    found = file_identities(folder)
    assert found is not None
    root, listed = found
    placement = Placement()
    identity = (recipe or Recipe()).identity(root, placement)
    components = request_components(identity, placement, level)
    return acquire_request_pb(
        Acquisition(
            request_id=uuid.uuid4().hex,
            fingerprint=Fingerprint("", level, components),
            checkpoint_path=str(root),
            ttl=10.0,
            environment=Environment(),
            pid=os.getpid(),
            files=listed if files is None else files,
            tensor_format=tensor_format,
        )
    )


def _acquire(socket: str, request: pb.AcquireRequest) -> pb.AcquireResponse:
    with service_stub(socket) as stub:
        reply: pb.AcquireResponse = stub.Acquire(request, timeout=30)
        stub.Release(pb.ReleaseRequest(lease_id=reply.lease.lease_id), timeout=10)
    return reply


def _refusal(socket: str, request: pb.AcquireRequest) -> tuple[grpc.StatusCode, str]:
    with service_stub(socket) as stub, pytest.raises(grpc.RpcError) as raised:
        stub.Acquire(request, timeout=30)
    failure = rpc_failure(raised.value)
    return failure.code, failure.reason


def _matches(daemon: Daemon) -> list[str]:
    """How each Acquire the daemon granted found its model: "files" or "fingerprint"."""
    return [m.group(1) for m in _ACQUIRED.finditer(daemon.log())]


def test_files_listed_are_the_index_and_every_safetensors_file(copied: Path) -> None:
    (copied / "stray.safetensors").write_bytes(b"not read")
    (copied / "README.md").write_text("not listed")

    found = file_identities(copied)

    assert found is not None
    root, files = found
    assert root == copied.resolve()
    names = [*(p.name for p in copied.glob("*.safetensors")), INDEX_FILE]
    assert sorted(files) == sorted(names)
    for name, identity in files.items():
        st = os.stat(copied / name)
        assert identity == FileIdentity(
            st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
        )


def test_files_of_a_single_file_and_of_a_symlinked_shard(
    checkpoints: Checkpoints, tmp_path: Path
) -> None:
    single = checkpoints.single / "model.safetensors"
    link = tmp_path / "linked"
    link.mkdir()
    (link / "model.safetensors").symlink_to(single)

    by_file, by_link = file_identities(single), file_identities(link)

    assert by_file is not None and by_link is not None
    assert by_file[0] == checkpoints.single.resolve()
    assert by_file[1] == by_link[1] == {"model.safetensors": FileIdentity.of_stat(single.stat())}
    assert file_identities(tmp_path / "absent") is None


def test_the_loaded_files_are_the_checkpoints_file_identities(copied: Path) -> None:
    found = file_identities(copied)
    with open_checkpoint(copied) as checkpoint:
        loaded = checkpoint.file_identities()

    assert found is not None
    assert loaded == found[1]
    assert INDEX_FILE in loaded


def test_acquire_by_files_grants_the_model_with_its_whole_fingerprint(
    holder: Daemon, copied: Path
) -> None:
    with open_checkpoint(copied) as checkpoint:
        expected = compute_fingerprint(checkpoint, Recipe(), Placement(), DEFAULT_LEVEL)

    table = _acquire(holder.socket, _by_files(copied))
    views = _acquire(holder.socket, _by_files(copied, tensor_format="views"))

    assert fingerprint_from_pb(table.model.fingerprint) == expected
    assert table.HasField("tensor_table") and not table.tensors
    assert views.tensors and not views.HasField("tensor_table")
    assert grant_from_pb(table).tensors == grant_from_pb(views).tensors
    assert _matches(holder) == ["files", "files"]


def test_acquire_by_files_ignores_files_the_model_does_not_use(
    holder: Daemon, copied: Path
) -> None:
    (copied / "stray.safetensors").write_bytes(b"not read")

    reply = _acquire(holder.socket, _by_files(copied))

    assert reply.model.name == "sharded"


@pytest.mark.parametrize("case", ["index-missing", "shard-missing", "shard-touched", "recopied"])
def test_acquire_by_files_needs_every_loaded_file_unchanged(
    holder: Daemon, copied: Path, case: str
) -> None:
    found = file_identities(copied)
    assert found is not None
    files = dict(found[1])
    if case == "index-missing":
        del files[INDEX_FILE]
    elif case == "shard-missing":
        del files[SHARD_2]
    elif case == "shard-touched":  # same bytes, new mtime and ctime
        os.utime(copied / SHARD_2, ns=(1, 1))
        files = {}
    else:  # same bytes, a new inode
        shutil.copyfile(copied / SHARD_2, copied / "tmp")
        os.replace(copied / "tmp", copied / SHARD_2)
        files = {}

    code, reason = _refusal(holder.socket, _by_files(copied, files=files or None))

    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND")


@pytest.mark.parametrize("case", ["dtype", "level"])
def test_acquire_by_files_needs_the_same_recipe_and_level(
    holder: Daemon, copied: Path, case: str
) -> None:
    request = (
        _by_files(copied, recipe=Recipe("F16"))
        if case == "dtype"
        else _by_files(copied, level="layout")
    )

    assert _refusal(holder.socket, request) == (grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND")


def test_request_components_are_those_of_the_whole_fingerprint(copied: Path) -> None:
    with open_checkpoint(copied) as checkpoint:
        for recipe, placement in [(Recipe(), Placement()), (Recipe("F16"), Placement())]:
            whole = compute_fingerprint(checkpoint, recipe, placement, "full")
            alone = request_components(
                recipe.identity(checkpoint.root, placement), placement, "full"
            )

            assert alone == {n: whole.components[n] for n in REQUEST_COMPONENTS}


def test_load_of_the_loaded_files_attaches_by_them(
    holder: Daemon, copied: Path, workers: WorkerPool, tmp_path: Path
) -> None:
    with open_checkpoint(copied) as checkpoint:
        expected = compute_fingerprint(checkpoint, Recipe(), Placement(), DEFAULT_LEVEL)
        metadata = checkpoint.metadata

    reply = workers.start().load(copied, socket=holder.socket, dump=tmp_path / "w")

    assert_attached(reply)
    assert reply["fingerprint"] == expected.digest
    assert reply["metadata"] == metadata
    assert _matches(holder) == ["files"]
    assert_bitwise_equal(load_file(tmp_path / "w"), weightcache.load_from_disk(copied).tensors)


@pytest.mark.parametrize("change", ["touched", "recopied"])
def test_load_of_the_same_bytes_in_other_files_attaches_by_fingerprint(
    holder: Daemon, copied: Path, workers: WorkerPool, tmp_path: Path, change: str
) -> None:
    if change == "touched":
        os.utime(copied / SHARD_2, ns=(1, 1))
    else:
        shutil.copyfile(copied / SHARD_2, copied / "tmp")
        os.replace(copied / "tmp", copied / SHARD_2)

    reply = workers.start().load(copied, socket=holder.socket, dump=tmp_path / "w")

    assert_attached(reply)
    assert _matches(holder) == ["fingerprint"]
    assert_bitwise_equal(load_file(tmp_path / "w"), weightcache.load_from_disk(copied).tensors)


def test_weights_attached_by_files_read_their_checkpoint_on_first_access(
    holder: Daemon, copied: Path
) -> None:
    with weightcache.load(copied, socket=holder.socket, fallback=False) as weights:
        checkpoint = weights.checkpoint

        assert weights.source == "cache"
        assert _matches(holder) == ["files"]
        assert checkpoint.root == copied.resolve()
        assert sorted(checkpoint.tensors) == sorted(weights.tensors)
        assert weights.checkpoint is checkpoint


def test_a_single_file_given_as_such_attaches_by_identity_and_reads_that_file(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    folder = tmp_path / "one"
    folder.mkdir()
    weights_file = folder / "weights.safetensors"
    shutil.copyfile(checkpoints.single / "model.safetensors", weights_file)
    daemon = daemons.start([weights_file])

    with weightcache.load(weights_file, socket=daemon.socket, fallback=False) as weights:
        checkpoint = weights.checkpoint

        assert weights.source == "cache"
        assert _matches(daemon) == ["files"]
        assert [shard.name for shard in checkpoint.shards] == ["weights.safetensors"]
        assert_bitwise_equal(weights.tensors, checkpoints.tensors)
