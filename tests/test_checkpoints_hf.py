"""Hugging Face checkpoint layouts through a real daemon and a worker process.

- the hub cache (``models--org--name/snapshots/<rev>/`` symlinking into ``blobs/``),
  addressed by snapshot path, branch and commit; ``full`` fingerprints of blobs from
  their bytes, read once (a blob's name is not trusted);
- a sharded folder with stray ``.safetensors`` files the index does not name;
- ``__metadata__`` preserved and exposed on both sides;
- tied embeddings: stored once and tied in the module, or stored twice and served so;
  a distinct ``lm_head.weight`` under a tying config is untied, as ``from_pretrained`` does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

import weightcache
import weightcache.core.hashcache
from tests.recipe_support import (
    TEST_TIMEOUT,
    HashCounter,
    HubRepo,
    RecipeWorker,
    RecipeWorkerPool,
    build_llama,
    children_env,
    start_daemons,
    wait_ready,
    write_hub_repo,
    write_shards,
)
from tests.support import (
    INDEX_FILE,
    SHARD_1,
    SHARD_2,
    SHARD_OF,
    SINGLE_FILE,
    Checkpoints,
    Daemon,
    DaemonPool,
    assert_attached,
    assert_bitwise_equal,
    get_model,
    reference_tensors,
    rpc_failure,
    service_stub,
)
from weightcache.testing import wait_until_settled
from weightcache.v1 import weight_cache_service_pb2 as pb

pytestmark = pytest.mark.timeout(TEST_TIMEOUT)

REPO_ID = "acme/tiny-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
#: Several keys, one of them not ASCII: all must come back as written.
METADATA = {"format": "pt", "license": "apache-2.0", "producer": "weightcache tests \u2713"}
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def split(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """``reference_tensors`` in the two shards of :data:`tests.support.SHARD_OF`."""
    return {s: {n: t for n, t in tensors.items() if SHARD_OF[n] == s} for s in (SHARD_1, SHARD_2)}


@dataclass(frozen=True)
class Setup:
    """Checkpoints (each with other bytes, so that no two share a fingerprint), one daemon
    preloading all of them as stored, and one worker.

    Attributes:
        hub: a hub-cache repo (``reference_tensors(seed=2)`` in two shards).
        stray: two shards + index (seed 3), plus a valid ``model.safetensors`` and a
            garbage ``zz-extra.safetensors`` that the index does not name.
        meta: two shards + index (seed 4) with :data:`METADATA`.
        tied_once: a tied Llama saved by ``save_pretrained`` (the embedding once).
        tied_both: the same weights with ``lm_head.weight`` stored as a second copy.
        tied_distinct: the same config (``tie_word_embeddings``) with an ``lm_head.weight``
            of its own (other values than the embedding).
    """

    hub: HubRepo
    stray: Path
    meta: Path
    tied_once: Path
    tied_both: Path
    tied_distinct: Path
    daemon: Daemon
    worker: RecipeWorker


@pytest.fixture(scope="module")
def setup(module_daemons: DaemonPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("hf")
    source = write_shards(base / "hub-source", split(reference_tensors(seed=2)))
    hub = write_hub_repo(base / "hub", REPO_ID, source, COMMIT)
    stray = write_shards(base / "stray", split(reference_tensors(seed=3)))
    save_file({"stray.weight": torch.ones(3)}, str(stray / SINGLE_FILE))
    (stray / "zz-extra.safetensors").write_bytes(b"\xff" * 64)
    meta = write_shards(base / "meta", split(reference_tensors(seed=4)), metadata=METADATA)
    tied_once = build_llama(base / "tied-once", seed=1, max_shard_size=None, tie=True)
    tied_both = base / "tied-both"
    shutil.copytree(tied_once, tied_both)
    stored = load_file(tied_both / SINGLE_FILE)
    assert LM_HEAD not in stored
    stored[LM_HEAD] = stored[EMBED].clone()
    save_file(stored, str(tied_both / SINGLE_FILE), metadata={"format": "pt"})
    tied_distinct = base / "tied-distinct"
    shutil.copytree(tied_once, tied_distinct)
    gen = torch.Generator().manual_seed(9)
    stored[LM_HEAD] = torch.randn(stored[EMBED].shape, generator=gen, dtype=stored[EMBED].dtype)
    save_file(stored, str(tied_distinct / SINGLE_FILE), metadata={"format": "pt"})

    wait_until_settled(base)  # past the timestamp granule: digests may be remembered
    env = children_env(base / "hash-cache")
    models = [hub.snapshot, stray, meta, tied_once, tied_both, tied_distinct]
    daemons = start_daemons(module_daemons, env, {"d": [str(m) for m in models]})
    workers = RecipeWorkerPool(base, env)
    worker = workers.start()
    try:
        wait_ready(daemons.values())
        yield Setup(hub, stray, meta, tied_once, tied_both, tied_distinct, daemons["d"], worker)
    finally:
        workers.close()


@pytest.fixture
def worker(setup: Setup) -> Iterator[RecipeWorker]:
    yield setup.worker
    setup.worker.close_all()


# -- the hub cache layout --------------------------------------------------------------


def test_hub_snapshot_resolves_branch_and_commit(setup: Setup) -> None:
    hub = setup.hub
    for revision in ("main", COMMIT):
        assert weightcache.hub_snapshot(hub.cache_root, REPO_ID, revision) == hub.snapshot
        checkpoint = weightcache.open_checkpoint(hub.cache_root, repo_id=REPO_ID, revision=revision)
        assert checkpoint.root == hub.snapshot.resolve()
        assert [s.name for s in checkpoint.shards] == [SHARD_1, SHARD_2]
        # Shards are read through the relative symlinks: their realpaths are the blobs.
        assert [s.path for s in checkpoint.shards] == [
            hub.blobs[SHARD_1].resolve(),
            hub.blobs[SHARD_2].resolve(),
        ]
        assert os.readlink(hub.snapshot / SHARD_1) == f"../../blobs/{hub.blobs[SHARD_1].name}"
    for repo, revision in ((REPO_ID, "no-such-branch"), ("acme/absent", "main")):
        with pytest.raises(weightcache.InvalidCheckpointError, match="is not in the hub cache"):
            weightcache.hub_snapshot(hub.cache_root, repo, revision)


@pytest.mark.parametrize("given", ["snapshot-path", "branch", "commit"])
def test_hub_checkpoint_attaches_bitwise(
    setup: Setup, worker: RecipeWorker, tmp_path: Path, given: str
) -> None:
    hub = setup.hub
    where = {"cache_root": str(hub.cache_root), "repo_id": REPO_ID}
    path = hub.snapshot if given == "snapshot-path" else None
    resolved = None if path else {**where, "revision": "main" if given == "branch" else COMMIT}

    reply = worker.load(
        path, hub=resolved, socket=setup.daemon.socket, fallback=False, dump=tmp_path / "w"
    )

    assert_attached(reply)
    assert reply["path"] == str(hub.snapshot)
    assert reply["model"] == COMMIT
    got = load_file(tmp_path / "w")
    assert_bitwise_equal(got, weightcache.load_from_disk(hub.snapshot).tensors)
    assert_bitwise_equal(got, reference_tensors(seed=2))
    held = get_model(setup.daemon.socket, COMMIT)
    assert held.path == str(hub.snapshot.resolve())


def _full(path: Path) -> weightcache.Fingerprint:
    checkpoint = weightcache.open_checkpoint(path)
    recipe, placement = weightcache.Recipe(), weightcache.Placement()
    return weightcache.compute_fingerprint(checkpoint, recipe, placement, "full")


def test_full_fingerprint_of_blobs_is_their_bytes_read_once(
    setup: Setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hash-cache"
    monkeypatch.setenv("WEIGHTCACHE_HASH_CACHE", str(cache))
    hashes = HashCounter(monkeypatch)
    plain = tmp_path / "plain"
    shutil.copytree(setup.hub.snapshot, plain)  # follows the symlinks: plain files
    assert not any(p.is_symlink() for p in plain.iterdir())
    wait_until_settled(plain)
    blob_names = sorted(setup.hub.blobs[shard].name for shard in (SHARD_1, SHARD_2))

    from_blobs = _full(setup.hub.snapshot)
    again = _full(setup.hub.snapshot)

    # A blob's name is a claim: its bytes are read, once per file identity.
    assert hashes.take() == blob_names
    assert again == from_blobs
    from_files = _full(plain)
    assert hashes.take() == [SHARD_1, SHARD_2]
    assert from_blobs == from_files
    for shard in (SHARD_1, SHARD_2):
        blob = setup.hub.blobs[shard]
        assert blob.name == hashlib.sha256(blob.read_bytes()).hexdigest()

    # Blobs named with other hashes give the hash of their bytes, not their names.
    fake = {f: hashlib.sha256(f"not {f}".encode()).hexdigest() for f in (SHARD_1, SHARD_2)}
    renamed = write_hub_repo(
        tmp_path / "hub", "acme/renamed", setup.hub.snapshot, COMMIT, blob_name=fake
    )
    wait_until_settled(tmp_path / "hub")
    for shard in (SHARD_1, SHARD_2):
        real = hashlib.sha256((plain / shard).read_bytes()).hexdigest()
        assert weightcache.core.hashcache.file_sha256(renamed.snapshot / shard) == real
    assert _full(renamed.snapshot) == from_files
    assert len(list(cache.iterdir())) == 6  # blobs, plain files, renamed blobs


# -- stray files and metadata -----------------------------------------------------------


def test_stray_safetensors_files_beside_an_index_are_ignored(
    setup: Setup, worker: RecipeWorker, tmp_path: Path
) -> None:
    stray = setup.stray
    checkpoint = weightcache.open_checkpoint(stray)
    assert [s.name for s in checkpoint.shards] == [SHARD_1, SHARD_2]
    expected = reference_tensors(seed=3)
    assert_bitwise_equal(weightcache.load_from_disk(stray).tensors, expected)
    clean = tmp_path / "clean"
    clean.mkdir()
    for file in (SHARD_1, SHARD_2, INDEX_FILE):
        shutil.copyfile(stray / file, clean / file)
    sampled = {
        p: weightcache.compute_fingerprint(
            weightcache.open_checkpoint(p), weightcache.Recipe(), weightcache.Placement()
        )
        for p in (stray, clean)
    }
    assert sampled[stray] == sampled[clean]
    assert sorted(sampled[stray].components) == [
        f"checkpoint/{SHARD_1}",
        f"checkpoint/{SHARD_2}",
        "format",
        "layout",
        "placement",
        "recipe",
    ]

    reply = worker.load(stray, socket=setup.daemon.socket, fallback=False, dump=tmp_path / "w")

    assert_attached(reply)
    assert reply["model"] == "stray"
    assert_bitwise_equal(load_file(tmp_path / "w"), expected)
    assert get_model(setup.daemon.socket, "stray").tensor_count == len(expected)


def test_metadata_is_preserved_and_exposed(
    setup: Setup, worker: RecipeWorker, checkpoints: Checkpoints
) -> None:
    reply = worker.load(setup.meta, socket=setup.daemon.socket, fallback=False)

    assert_attached(reply)
    assert reply["metadata"] == METADATA
    assert weightcache.load_from_disk(setup.meta).metadata == METADATA
    assert dict(get_model(setup.daemon.socket, "meta").metadata) == METADATA
    checkpoint = weightcache.open_checkpoint(setup.meta)
    assert [s.metadata for s in checkpoint.shards] == [METADATA, METADATA]
    held = get_model(setup.daemon.socket, "stray")  # written with {"format": "pt"}
    assert dict(held.metadata) == {"format": "pt"}


# -- tied embeddings ------------------------------------------------------------------


@pytest.mark.parametrize("stored", ["once", "twice"])
def test_tied_embeddings_stay_one_parameter_after_load_into(
    setup: Setup, worker: RecipeWorker, tmp_path: Path, stored: str
) -> None:
    folder = setup.tied_once if stored == "once" else setup.tied_both
    names = list(weightcache.open_checkpoint(folder).tensors)
    assert (LM_HEAD in names) is (stored == "twice")

    reply = worker.module("llama", folder, tmp_path / "out", socket=setup.daemon.socket)

    assert reply["ok"], reply
    assert (reply["source"], reply["fallback_reason"]) == ("cache", None)
    assert reply["model"] == folder.name
    assert reply["tensors"] == len(names)
    assert reply["tied_by_id"] == [[EMBED, LM_HEAD]]
    assert reply["tied_by_data_ptr"] == [[EMBED, LM_HEAD]]
    assert reply["disk_tied_by_id"] == [[EMBED, LM_HEAD]]
    assert (reply["warnings"], reply["disk_warnings"]) == ([], [])
    assert reply["params_in_shared_memory"] is True
    out = load_file(tmp_path / "out")
    assert out["cache"].shape == (1, 12, 128)
    assert_bitwise_equal({"logits": out["cache"]}, {"logits": out["disk"]})


@pytest.mark.parametrize("path", ["cache", "disk"])
def test_a_distinct_lm_head_is_untied_as_from_pretrained_does(
    setup: Setup, worker: RecipeWorker, tmp_path: Path, path: str
) -> None:
    # Issue 9 item 9: the config ties, the checkpoint has its own head. transformers'
    # from_pretrained warns and unties; load_into must do the same, from the daemon and
    # from disk (a socket nobody serves: the fallback), and load_from_disk + assign too.
    folder = setup.tied_distinct
    stored = load_file(folder / SINGLE_FILE)
    assert not torch.equal(stored[LM_HEAD], stored[EMBED])
    socket = setup.daemon.socket if path == "cache" else str(tmp_path / "nobody.sock")

    reply = worker.module("llama", folder, tmp_path / "out", socket=socket, pretrained=True)

    assert reply["ok"], reply
    assert reply["source"] == path
    if path == "cache":
        assert (reply["model"], reply["fallback_reason"]) == (folder.name, None)
        assert reply["params_in_shared_memory"] is True
    else:
        assert reply["fallback_reason"]["code"] == "DAEMON_UNAVAILABLE"
    assert (reply["tied_by_id"], reply["tied_by_data_ptr"], reply["disk_tied_by_id"]) == (
        [],
        [],
        [],
    )
    # The fallback also warns that it is loading from disk; nothing else may be logged.
    [warning] = [w for w in reply["warnings"] if w["event"] != "loading from disk"]
    assert warning["names"] == [EMBED, LM_HEAD]
    assert warning["event"].startswith("untied: the module ties these parameters")
    assert reply["disk_warnings"] == [warning]
    out = load_file(tmp_path / "out")
    assert out["pretrained"].shape == (1, 12, 128)
    assert_bitwise_equal({"logits": out["cache"]}, {"logits": out["pretrained"]})
    assert_bitwise_equal({"logits": out["disk"]}, {"logits": out["pretrained"]})


def test_a_checkpoint_storing_both_copies_is_served_as_stored(
    setup: Setup, worker: RecipeWorker, tmp_path: Path
) -> None:
    reply = worker.load(
        setup.tied_both, socket=setup.daemon.socket, fallback=False, dump=tmp_path / "w"
    )

    assert_attached(reply)
    assert reply["model"] == "tied-both"
    assert EMBED in reply["names"] and LM_HEAD in reply["names"]
    got = load_file(tmp_path / "w")
    assert_bitwise_equal(got, weightcache.load_from_disk(setup.tied_both).tensors)
    assert_bitwise_equal({"w": got[LM_HEAD]}, {"w": got[EMBED]})
    once = weightcache.load_from_disk(setup.tied_once).tensors
    assert sorted(got) == sorted([*once, LM_HEAD])
    assert_bitwise_equal({"w": got[EMBED]}, {"w": once[EMBED]})


# -- remote Preload of a hub snapshot under --model-root (issue 9, item 3) -------------


def test_remote_preload_of_a_hub_snapshot_follows_blob_links_only_inside_the_root(
    setup: Setup, daemons: DaemonPool
) -> None:
    hub = setup.hub
    request = pb.PreloadRequest(path=str(hub.snapshot))
    cache_root = daemons.start(args=["--allow-remote-preload", "--model-root", str(hub.cache_root)])
    snapshot_root = daemons.start(
        args=["--allow-remote-preload", "--model-root", str(hub.snapshot)]
    )

    with service_stub(cache_root.socket) as stub:
        replies = list(stub.Preload(request, timeout=60))
    with service_stub(snapshot_root.socket) as stub, pytest.raises(grpc.RpcError) as raised:
        list(stub.Preload(request, timeout=60))

    assert (replies[-1].model, replies[-1].state) == (COMMIT, pb.MODEL_STATE_READY)
    assert get_model(cache_root.socket, COMMIT).path == str(hub.snapshot.resolve())
    failure = rpc_failure(raised.value)
    assert (failure.code, failure.reason) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "PERMISSION_DENIED",
    )
    assert failure.metadata["path"] == str(hub.blobs[INDEX_FILE].resolve())  # opened first
    with service_stub(snapshot_root.socket) as stub:
        assert list(stub.ListModels(pb.ListModelsRequest(), timeout=10).models) == []
