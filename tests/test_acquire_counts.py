"""What ``weightcache_acquires_total`` counts (issue 28, item 3): per load a worker makes,
one ``granted`` (served from the cache) or one ``refused`` by reason (it falls back to
disk, or raises); the Acquires the SDK asks again after are not refusals: the miss of an
Acquire by file identity (``probe_missed``), and a ``MODEL_LOADING`` it waits out
(``waiting``: ``AcquireRequest.asks_again_if_loading``, false on its last attempt).

Real daemons, workers in their own processes, the exposition parsed with
prometheus-client's parser."""

from __future__ import annotations

import shutil
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.race_support import pause_step, preload_changing
from tests.recipe_support import RecipeWorkerPool, children_env, environ, recipe_json
from tests.support import (
    Checkpoints,
    DaemonPool,
    WorkerPool,
    assert_attached,
    rpc_failure,
    service_stub,
    wait_until,
)
from weightcache.testing.daemon import list_models
from weightcache.v1 import weight_cache_service_pb2 as pb


def acquires(port: int) -> dict[tuple[str, str], float]:
    """``weightcache_acquires_total`` by (result, reason), from the daemon's exposition."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.labels["result"], sample.labels["reason"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "weightcache_acquires"
        for sample in family.samples
        if sample.name == "weightcache_acquires_total"
    }


def test_loads_count_once_each_served_or_fallen_back_by_reason(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    daemon = daemons.start([checkpoints.single], args=["--metrics-listen", "127.0.0.1:0"])
    port = daemon.bound_port("metrics")
    copy = tmp_path / "copy"
    shutil.copytree(checkpoints.single, copy)  # other files: the probe by identity misses
    first, second = workers.start(), workers.start()

    same = first.load(checkpoints.single, socket=daemon.socket)
    absent = first.load(checkpoints.other, key="other", socket=daemon.socket)
    copied = second.load(copy, socket=daemon.socket)
    level = second.load(
        checkpoints.single, key="level", socket=daemon.socket, fingerprint_level="sampled"
    )

    assert_attached(same)
    assert_attached(copied)
    assert (absent["source"], absent["fallback_reason"]["code"]) == ("disk", "MODEL_NOT_FOUND")
    assert (level["source"], level["fallback_reason"]["code"]) == (
        "disk",
        "FINGERPRINT_MISMATCH",
    )
    # Four loads: two served, two fallen back (one per reason); the three misses of an
    # Acquire by file identity that each load of other files began with are probes.
    assert acquires(port) == {
        ("granted", ""): 2.0,
        ("refused", "MODEL_NOT_FOUND"): 1.0,
        ("refused", "FINGERPRINT_MISMATCH"): 1.0,
        ("probe_missed", "MODEL_NOT_FOUND"): 3.0,
    }


def test_a_loading_model_waited_for_counts_waiting_not_refused(
    daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """A load held (the ``pause`` plugin) while Acquires come: each that says it asks
    again counts ``waiting``, the one that does not ``refused``; the SDK's load that waits
    it out counts ``granted`` once."""
    root = tmp_path / "root"
    shutil.copytree(checkpoints.single, root / "model")
    env = children_env(tmp_path / "hash-cache")
    args = ["--allow-remote-preload", "--model-root", str(root), "--allow-recipe", "pause"]
    with environ(env):
        daemon = daemons.start(args=[*args, "--metrics-listen", "127.0.0.1:0"])
    port = daemon.bound_port("metrics")
    pool = RecipeWorkerPool(tmp_path, env)
    worker = pool.start()
    pause = tmp_path / "pause"
    answers: list[str] = []

    def while_loading() -> None:
        [model] = list_models(daemon.socket)
        assert model.state == pb.MODEL_STATE_LOADING
        with service_stub(daemon.socket) as stub:
            for again in (True, True, False):
                request = pb.AcquireRequest(
                    request_id=uuid.uuid4().hex,
                    fingerprint=model.fingerprint,
                    checkpoint_path=str(root / "model"),
                    asks_again_if_loading=again,
                )
                with pytest.raises(grpc.RpcError) as raised:
                    stub.Acquire(request, timeout=10)
                answers.append(rpc_failure(raised.value).reason)
        worker.send(
            "load",
            key="w",
            path=str(root / "model"),
            hub=None,
            recipe=recipe_json(plugins=[pause_step(pause)]),
            kwargs={
                "socket": daemon.socket,
                "fingerprint_level": "sampled",
                "fallback": False,
                "wait_timeout": 60.0,
            },
            dump=None,
        )
        # The worker has asked at least once, and waits.
        wait_until(lambda: acquires(port).get(("waiting", "MODEL_LOADING"), 0) >= 3, 60)

    try:
        done = preload_changing(
            daemon.socket, root / "model", pause, while_loading, pb.FINGERPRINT_LEVEL_SAMPLED
        )
        reply = worker.reply("load", timeout=120)
    finally:
        pool.close()

    assert isinstance(done, list) and done[-1].state == pb.MODEL_STATE_READY
    assert answers == ["MODEL_LOADING"] * 3
    assert_attached(reply)
    counted = acquires(port)
    waiting = counted.pop(("waiting", "MODEL_LOADING"))
    assert waiting >= 3  # two of the test's, and each of the worker's attempts before go
    assert counted == {("granted", ""): 1.0, ("refused", "MODEL_LOADING"): 1.0}
