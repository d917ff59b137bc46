"""Hugging Face Hub repo ids (issue 28, item 7): one resolver (``weightcache.core.hub``,
through ``huggingface_hub``'s cache API, offline) for the daemon's start-up models, the
Preload RPC (``PreloadRequest.repo_id``/``revision``, resolved in the daemon's own Hub
cache), ``weightcache load`` and the SDK's ``weightcache.load("org/name")``; a model
loaded from a repo id is named ``org/name`` (``org/name@REV`` when a revision is asked
for) in ``ls``, the log, the metrics and ``evict``, never by its snapshot's commit.

A real Hub cache layout (``models--acme--tiny/{blobs,refs,snapshots}``) in a temporary
folder, ``HF_HUB_CACHE`` pointing at it and ``HF_HUB_OFFLINE=1``; real daemons; workers
in separate processes."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from safetensors.torch import load_file

import weightcache
from tests.recipe_support import write_hub_repo
from tests.support import (
    Checkpoints,
    DaemonPool,
    WorkerPool,
    assert_attached,
    rpc_failure,
    run_cli,
    service_stub,
)
from tests.test_operators import log_events, run_cli_env
from tests.test_probes import scrape
from weightcache.core import hub
from weightcache.testing.checkpoints import assert_bitwise_equal
from weightcache.testing.daemon import list_models
from weightcache.v1 import weight_cache_service_pb2 as pb

REPO_ID = "acme/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ABSENT = (
    "acme/absent: no such file or folder, nor a Hub repo with revision main in the local "
    "Hub cache (download it first, e.g. `hf download`)"
)


class Hub:
    """A Hub cache holding ``single`` as ``acme/tiny`` at :data:`COMMIT`, as ``main`` and
    as the tag ``v1``."""

    def __init__(self, root: Path, source: Path) -> None:
        self.root = root
        repo = write_hub_repo(root, REPO_ID, source, COMMIT)
        (repo.snapshot.parent.parent / "refs" / "v1").write_text(COMMIT)
        self.snapshot = repo.snapshot
        self.env = {"HF_HUB_CACHE": str(root), "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def cache(checkpoints: Checkpoints, tmp_path: Path) -> Hub:
    return Hub(tmp_path / "hub", checkpoints.single)


cli = run_cli_env
json_lines = log_events


def test_the_resolver_names_the_snapshot_and_the_model(
    cache: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(cache.root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads its environment once, at import: another test may have
    # imported it already, so its constant is set too.
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache.root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    found = hub.find(REPO_ID)
    tagged = hub.find(f"{REPO_ID}@v1")

    assert found == hub.HubModel(str(cache.snapshot), REPO_ID, None, COMMIT)
    assert tagged is not None
    assert (found.name, tagged.name, tagged.path) == (REPO_ID, "acme/tiny@v1", found.path)
    assert hub.find(str(cache.snapshot)) is None  # a path is a path
    assert hub.resolve_or_keep("acme/absent") == ("acme/absent", None, ABSENT)
    with pytest.raises(weightcache.InvalidCheckpointError, match="revision v2 in the local"):
        hub.find(REPO_ID, "v2")


def test_start_up_models_are_named_by_repo_id(
    daemons: DaemonPool, cache: Hub, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start(
        [REPO_ID, f"{REPO_ID}@v1"],
        args=["--metrics-listen", "127.0.0.1:0", "--log-format", "json"],
        env=cache.env,
    )
    port = daemon.bound_port("metrics")

    [model] = list_models(daemon.socket)  # @v1 is the same snapshot: already held
    ls = run_cli("ls", "--socket", daemon.socket)
    samples = scrape(port)

    assert (model.name, model.path, model.state) == (
        REPO_ID,
        str(cache.snapshot.resolve()),
        pb.MODEL_STATE_READY,
    )
    assert ls.returncode == 0
    assert [line.split()[0] for line in ls.stdout.splitlines()[1:]] == [REPO_ID]
    assert COMMIT not in ls.stdout
    [loaded] = json_lines(daemon.log(), "loaded")
    assert loaded["model"] == REPO_ID
    assert samples["weightcache_model_bytes", (("model", REPO_ID),)] == model.size_bytes

    evicted = run_cli("evict", REPO_ID, "--socket", daemon.socket)

    assert (evicted.returncode, evicted.stdout, evicted.stderr) == (0, f"evicted {REPO_ID}\n", "")
    assert list_models(daemon.socket) == []


def test_a_revision_asked_for_is_in_the_name(daemons: DaemonPool, cache: Hub) -> None:
    daemon = daemons.start([f"{REPO_ID}@v1"], dtype="F16", env=cache.env)

    [model] = list_models(daemon.socket)

    assert (model.name, model.path) == ("acme/tiny@v1-f16", str(cache.snapshot.resolve()))


def test_load_sends_the_repo_id_for_the_daemon_to_resolve(
    daemons: DaemonPool, cache: Hub, tmp_path: Path
) -> None:
    daemon = daemons.start(
        args=[
            *("--allow-remote-preload", "--model-root", str(cache.root)),
            *("--metrics-listen", "127.0.0.1:0"),
        ],
        env=cache.env,
    )
    port = daemon.bound_port("metrics")
    # This command's Hub cache is empty: the daemon's own holds the repo.
    empty = tmp_path / "empty-hub"
    empty.mkdir()
    elsewhere = {"HF_HUB_CACHE": str(empty), "HF_HUB_OFFLINE": "1"}

    loaded = cli("load", f"{REPO_ID}@main", "--socket", daemon.socket, env=elsewhere)
    absent = cli("load", "acme/absent", "--socket", daemon.socket, env=elsewhere)

    [model] = list_models(daemon.socket)
    assert (model.name, model.path, model.state) == (
        "acme/tiny@main",
        str(cache.snapshot.resolve()),
        pb.MODEL_STATE_READY,
    )
    assert (loaded.returncode, loaded.stdout) == (
        0,
        f"acme/tiny@main READY {model.progress.bytes_total} bytes\n",
    )
    assert (absent.returncode, absent.stdout, absent.stderr) == (
        1,
        "",
        f"weightcache load: INVALID_CHECKPOINT: {ABSENT}\n",
    )
    preloads = {k[1]: v for k, v in scrape(port).items() if k[0] == "weightcache_preloads_total"}
    assert preloads == {
        (("reason", ""), ("result", "ready")): 1.0,
        (("reason", "INVALID_CHECKPOINT"), ("result", "refused")): 1.0,
    }


def test_a_repo_id_outside_the_model_roots_is_refused(
    daemons: DaemonPool, cache: Hub, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    root.mkdir()
    daemon = daemons.start(
        args=["--allow-remote-preload", "--model-root", str(root)], env=cache.env
    )

    result = cli("load", REPO_ID, "--socket", daemon.socket, env=cache.env)

    real = cache.snapshot.resolve()
    assert (result.returncode, result.stdout, result.stderr) == (
        1,
        "",
        f"weightcache load: PERMISSION_DENIED: {real} resolves to {real}, outside every "
        "--model-root\n",
    )
    assert list_models(daemon.socket) == []


def test_a_worker_loads_a_repo_id_from_the_daemon(
    daemons: DaemonPool, workers: WorkerPool, cache: Hub, tmp_path: Path
) -> None:
    daemon = daemons.start([REPO_ID], env=cache.env)
    worker = workers.start(env=cache.env)

    by_id = worker.load(REPO_ID, socket=daemon.socket, dump=tmp_path / "by-id.safetensors")
    by_tag = worker.load(f"{REPO_ID}@v1", key="tag", socket=daemon.socket)
    absent = worker.load("acme/absent", key="absent", socket=daemon.socket)

    assert_attached(by_id)
    assert_attached(by_tag)
    assert (by_id["model"], by_tag["model"]) == (REPO_ID, REPO_ID)
    on_disk = weightcache.load_from_disk(cache.snapshot)
    assert_bitwise_equal(load_file(tmp_path / "by-id.safetensors"), on_disk.tensors)
    assert (absent["ok"], absent["error"]["type"], absent["error"]["detail"]) == (
        False,
        "InvalidCheckpointError",
        ABSENT,
    )


#: Revisions that are neither a commit hash nor a ref name git accepts (check-ref-format).
BAD_REVISIONS = (
    "../../../../dev/zero",
    "refs/../main",
    ".hidden",
    "main.lock",
    "main@{1}",
    "/main",
    "main/",
    "a//b",
    "a b",
    "@",
)


def test_a_revision_is_checked_before_any_file_is_opened(daemons: DaemonPool, cache: Hub) -> None:
    # Before (issue 37, item 2): the daemon opened refs/<revision> and read it whole before
    # the model-root check: ../../../../dev/zero took it from 265 MB to 3.46 GB, and a FIFO
    # pinned its threads (SIGTERM no longer stopped it). Each ref file planted here is
    # refused the same way: a FIFO, a symlink to /dev/zero, a file too large for a ref.
    refs = cache.snapshot.parent.parent / "refs"
    os.mkfifo(refs / "fifo")
    (refs / "zero").symlink_to("/dev/zero")
    (refs / "big").write_text(COMMIT * 100)
    (refs / "junk").write_text("not a commit")
    daemon = daemons.start(
        args=["--allow-remote-preload", "--model-root", str(cache.root)], env=cache.env
    )

    def refusal(revision: str) -> tuple[grpc.StatusCode, str, dict[str, str]]:
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Preload(pb.PreloadRequest(repo_id=REPO_ID, revision=revision), timeout=10))
        failure = rpc_failure(caught.value)
        return failure.code, failure.reason, failure.metadata

    with service_stub(daemon.socket) as stub:
        malformed = {revision: refusal(revision) for revision in BAD_REVISIONS}
        planted = {name: refusal(name) for name in ("fifo", "zero", "big", "junk")}
        [*_, ready] = stub.Preload(pb.PreloadRequest(repo_id=REPO_ID, revision="v1"), timeout=30)

    assert malformed == dict.fromkeys(
        BAD_REVISIONS,
        (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", {"field": "revision"}),
    )
    assert planted == dict.fromkeys(
        ("fifo", "zero", "big", "junk"),
        (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CHECKPOINT", {}),
    )
    assert (ready.model, ready.state) == ("acme/tiny@v1", pb.MODEL_STATE_READY)
    daemon.stop_and_check()  # SIGTERM honoured: no thread is stuck on a FIFO
