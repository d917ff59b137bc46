"""Tensor-parallel plans against transformers (issue 27, items 13 and 14).

- every style transformers' ``ParallelInterface`` registers and weightcache accepts places
  on each rank the bytes transformers' own ``shard_param`` places there (a fake process
  group of ``tp_size`` ranks, one at a time, in a child process);
- a plan that would split a key/value head across ranks is refused with
  ``INVALID_RECIPE`` naming the heads, by the SDK and by a daemon's remote Preload.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

import weightcache
from tests.recipe_support import LLAMA_CONFIG, TEST_TIMEOUT, build_llama, preload
from tests.support import Daemon, DaemonPool, rpc_failure
from weightcache.core.errors import RecipeError
from weightcache.core.recipe import Placement, Recipe
from weightcache.core.sidefiles import MAX_SIDE_FILE_BYTES
from weightcache.core.tp import FORWARD_ONLY_STYLES, REFUSED_STYLES, TRANSFORMERS_STYLES, TPPlan
from weightcache.testing import child_env
from weightcache.v1 import weight_cache_service_pb2 as pb

pytestmark = pytest.mark.timeout(TEST_TIMEOUT)

#: Tensors of a Linear(in=8, out=12) and an Embedding(16, 8), sharded over 4 ranks.
TP_SIZE = 4
SHARDING_SCRIPT = r"""
import json, sys
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

styles, size, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
result = {}
for rank in range(size):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))
    for style in styles:
        torch.manual_seed(0)
        linear = torch.nn.Linear(8, 12)
        embedding = torch.nn.Embedding(16, 8)
        for prefix, module, params in (("linear", linear, ("weight", "bias")),
                                       ("embedding", embedding, ("weight",))):
            for param in params:
                key = f"{style}/{prefix}.{param}/{rank}"
                try:
                    ALL_PARALLEL_STYLES[style].shard_param(module, param, mesh)
                except Exception as exc:
                    result[key] = None
                    continue
                tensor = module._parameters[param].data
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                result[key] = [list(local.shape), local.contiguous().view(-1).tolist()]
    dist.destroy_process_group()
json.dump({"registered": sorted(ALL_PARALLEL_STYLES), "shards": result}, open(out, "w"))
"""


@pytest.fixture(scope="module")
def transformers_shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """What transformers' own ``shard_param`` places on each rank, for every style."""
    out = tmp_path_factory.mktemp("tp") / "shards.json"
    subprocess.run(
        [
            sys.executable,
            "-c",
            SHARDING_SCRIPT,
            json.dumps(sorted(TRANSFORMERS_STYLES)),
            str(TP_SIZE),
            str(out),
        ],
        check=True,
        env=child_env(),
        timeout=120,
    )
    doc: dict[str, object] = json.loads(out.read_text())
    return doc


def test_every_style_transformers_registers_is_mapped_or_deliberately_refused(
    transformers_shards: dict[str, object],
) -> None:
    registered = set(transformers_shards["registered"])  # type: ignore[call-overload]
    refused = registered - set(TRANSFORMERS_STYLES)
    # A style transformers adds is either mapped (and checked below) or refused with a reason.
    assert refused <= set(REFUSED_STYLES)
    assert not set(REFUSED_STYLES) & set(TRANSFORMERS_STYLES)
    for style in ("colwise_gather_output", "rowwise_split_input"):
        plan = TPPlan.from_mapping({"layers.*.mlp.gate_up_proj": style})
        assert plan.rules == (("layers.*.mlp.gate_up_proj", TRANSFORMERS_STYLES[style]),)
    for style, reason in REFUSED_STYLES.items():
        with pytest.raises(RecipeError) as refusal:
            TPPlan.from_mapping({"layers.*.self_attn.k_proj": style})
        assert str(refusal.value) == (
            f"tensor-parallel rule 'layers.*.self_attn.k_proj': unsupported style {style!r} "
            f"({reason})"
        )


@pytest.mark.parametrize("style", sorted(TRANSFORMERS_STYLES))
def test_each_accepted_style_places_transformers_bytes_on_every_rank(
    style: str, transformers_shards: dict[str, object], tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    if style not in transformers_shards["registered"]:  # type: ignore[operator]
        pytest.skip(f"{style!r}: an older transformers name, not registered by this one")
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 12)
    embedding = torch.nn.Embedding(16, 8)
    tensors = {
        "linear.weight": linear.weight.detach(),
        "linear.bias": linear.bias.detach(),
        "embedding.weight": embedding.weight.detach(),
    }
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    plan = TPPlan.from_mapping({"linear": style, "embedding": style})
    shards = transformers_shards["shards"]
    compared = 0
    for rank in range(TP_SIZE):
        ours = weightcache.load_from_disk(
            folder, recipe=Recipe(tp_plan=plan), tp_rank=rank, tp_size=TP_SIZE
        ).tensors
        for name, tensor in ours.items():
            theirs = shards[f"{style}/{name}/{rank}"]  # type: ignore[index]
            if theirs is None:  # transformers cannot shard it so (a 1-D Shard(1))
                continue
            shape, values = theirs
            assert list(tensor.shape) == shape, (style, name, rank)
            assert tensor.contiguous().view(-1).tolist() == values, (style, name, rank)
            compared += 1
    assert compared >= 2 * TP_SIZE


def test_forward_only_rules_never_shadow_a_parameter_rule() -> None:
    plan = TPPlan.from_mapping(
        {"layers.*.mlp.experts": "moe_tp_experts", "layers.*.mlp.experts.down_proj": "rowwise"}
    )
    assert plan.rules == (
        ("layers.*.mlp.experts.down_proj", "rowwise"),
        ("layers.*.mlp.experts", "replicate"),
    )
    assert plan.style_for("layers.0.mlp.experts.down_proj") == "rowwise"
    assert plan.style_for("layers.0.mlp.experts.gate_up_proj") == "replicate"
    assert "moe_tp_experts" in FORWARD_ONLY_STYLES


# -- item 13: key/value heads ----------------------------------------------------------


@pytest.fixture(scope="module")
def llama_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model root holding a tiny Llama with 4 query and 2 key/value heads of 16 rows."""
    root = tmp_path_factory.mktemp("tp-root")
    build_llama(root / "llama", seed=0, max_shard_size=None, tie=False)
    return root


@pytest.fixture(scope="module")
def remote(module_daemons: DaemonPool, llama_root: Path) -> Iterator[Daemon]:
    daemon = module_daemons.start(args=("--allow-remote-preload", "--model-root", str(llama_root)))
    yield daemon


def test_a_tp_size_over_the_key_value_heads_is_refused_naming_them(llama_root: Path) -> None:
    assert LLAMA_CONFIG["num_key_value_heads"] == 2
    # 4 ranks: k_proj's 32 rows would split evenly, half a head each (before: accepted).
    with pytest.raises(RecipeError) as info:
        weightcache.load_from_disk(llama_root / "llama", tp_rank=0, tp_size=4)
    assert info.value.reason == "INVALID_RECIPE"
    assert "2 attention heads (num_key_value_heads=2 in config.json)" in info.value.detail
    assert "tp_size 4" in info.value.detail
    # Recipe.identity (the fingerprint without reading tensors) refuses alike.
    with pytest.raises(RecipeError, match="num_key_value_heads=2"):
        Recipe().identity(llama_root / "llama", Placement(0, 4))
    # A plan that replicates the key/value projections is accepted.
    plan = TPPlan.from_mapping(
        {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    )
    weights = weightcache.load_from_disk(
        llama_root / "llama", recipe=Recipe(tp_plan=plan), tp_rank=3, tp_size=4
    )
    assert weights.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert weights.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (16, 64)
    # tp_size 2 divides both counts: the default plan applies.
    weights = weightcache.load_from_disk(llama_root / "llama", tp_rank=1, tp_size=2)
    assert weights.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)


def test_the_daemon_refuses_a_tp_size_over_the_key_value_heads(
    remote: Daemon, llama_root: Path
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        preload(remote.socket, llama_root / "llama", tp_rank=0, tp_size=4)
    failure = rpc_failure(info.value)
    assert (failure.code, failure.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_RECIPE")
    assert "num_key_value_heads=2" in failure.message
    # the daemon keeps serving: tp_size 2 loads.
    replies = preload(remote.socket, llama_root / "llama", tp_rank=0, tp_size=2)
    assert (replies[-1].model, replies[-1].state) == ("llama-tp0of2", pb.MODEL_STATE_READY)


def test_a_config_json_that_is_not_a_small_regular_file_inside_the_folder_is_refused(
    remote: Daemon, llama_root: Path, tmp_path: Path
) -> None:
    # Before (issue 37, item 6): a tensor-parallel Preload without a plan read config.json
    # whole, through symlinks: /dev/zero grew the daemon by 2.85 GB in 5.9 s, and a FIFO
    # hung the Preload and the daemon's SIGTERM. One reader now (core.sidefiles).
    outside = tmp_path / "config.json"
    shutil.copyfile(llama_root / "llama" / "config.json", outside)
    planted: dict[str, Callable[[Path], object]] = {
        "cfg-zero": lambda config: config.symlink_to("/dev/zero"),
        "cfg-fifo": os.mkfifo,
        "cfg-big": lambda config: config.write_bytes(b" " * (MAX_SIDE_FILE_BYTES + 1)),
        "cfg-outside": lambda config: config.symlink_to(outside),
    }
    for name, plant in planted.items():
        folder = llama_root / name
        if not folder.exists():
            shutil.copytree(llama_root / "llama", folder)
            (folder / "config.json").unlink()
            plant(folder / "config.json")
    refused = {}
    for name in planted:
        with pytest.raises(grpc.RpcError) as info:
            preload(remote.socket, llama_root / name, tp_rank=0, tp_size=2)
        failure = rpc_failure(info.value)
        refused[name] = (failure.code, failure.reason, failure.message.split(": ", 1)[1])
    with pytest.raises(weightcache.InvalidCheckpointError, match="not a regular file"):
        weightcache.load_from_disk(llama_root / "cfg-fifo", tp_rank=0, tp_size=2)

    code = grpc.StatusCode.INVALID_ARGUMENT
    assert refused == {
        "cfg-zero": (code, "INVALID_CHECKPOINT", "not a regular file"),
        "cfg-fifo": (code, "INVALID_CHECKPOINT", "not a regular file"),
        "cfg-big": (code, "INVALID_CHECKPOINT", f"over {MAX_SIDE_FILE_BYTES} bytes"),
        "cfg-outside": (
            code,
            "INVALID_CHECKPOINT",
            f"resolves to {outside.resolve()}, outside {(llama_root / 'cfg-outside').resolve()}",
        ),
    }
    # The daemon keeps serving: the same folder with its own config.json loads.
    replies = preload(remote.socket, llama_root / "llama", tp_rank=1, tp_size=2)
    assert (replies[-1].model, replies[-1].state) == ("llama-tp1of2", pb.MODEL_STATE_READY)
