"""Checkpoint validation and fingerprints, in process (no daemon)."""

from __future__ import annotations

import os
import re
import shutil
from concurrent import futures
from pathlib import Path

import pytest

import weightcache
from tests.race_support import pause_step, rewrite_data_in_place, wait_reached
from tests.recipe_support import PLUGINS
from tests.support import (
    MALFORMED,
    SHARD_1,
    SHARD_2,
    SMALL_TENSOR,
    Checkpoints,
    copy_with_zeroed_tensor,
    write_malformed,
)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_open_checkpoint_refuses_malformed(tmp_path: Path, case: str) -> None:
    folder = write_malformed(tmp_path / case, case)

    with pytest.raises(
        weightcache.InvalidCheckpointError, match=re.escape(MALFORMED[case].message)
    ):
        weightcache.open_checkpoint(folder)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_load_refuses_malformed_without_falling_back(tmp_path: Path, case: str) -> None:
    folder = write_malformed(tmp_path / case, case)

    with pytest.raises(weightcache.InvalidCheckpointError) as raised:
        weightcache.load(folder, socket=str(tmp_path / "none.sock"))
    assert raised.value.reason == "INVALID_CHECKPOINT"


def test_open_checkpoint_reads_single_and_sharded_alike(checkpoints: Checkpoints) -> None:
    single = weightcache.open_checkpoint(checkpoints.single)
    sharded = weightcache.open_checkpoint(checkpoints.sharded)

    assert [s.name for s in single.shards] == ["model.safetensors"]
    assert [s.name for s in sharded.shards] == [SHARD_1, SHARD_2]
    assert sorted(single.tensors) == sorted(sharded.tensors) == sorted(checkpoints.tensors)
    assert single.nbytes == sharded.nbytes
    assert sharded.tensors[SMALL_TENSOR].shard == SHARD_2
    assert sharded.metadata == single.metadata == {"format": "pt"}
    assert sharded.tensors["layers.0.empty"].shape == (0, 4)
    assert sharded.tensors["layers.1.scale"].shape == ()


def _fingerprint(folder: Path, level: str, **recipe: str) -> weightcache.Fingerprint:
    checkpoint = weightcache.open_checkpoint(folder)
    return weightcache.compute_fingerprint(
        checkpoint,
        weightcache.Recipe(**recipe),  # type: ignore[arg-type]
        weightcache.Placement(),
        level,  # type: ignore[arg-type]
    )


def test_fingerprint_names_one_component_per_shard(checkpoints: Checkpoints) -> None:
    fp = _fingerprint(checkpoints.sharded, "sampled")

    assert sorted(fp.components) == [
        f"checkpoint/{SHARD_1}",
        f"checkpoint/{SHARD_2}",
        "format",
        "layout",
        "placement",
        "recipe",
    ]
    assert re.fullmatch(r"[0-9a-f]{64}", fp.digest)
    assert all(re.fullmatch(r"[0-9a-f]{64}", d) for d in fp.components.values())
    assert fp == _fingerprint(checkpoints.sharded, "sampled")


def test_fingerprint_ignores_the_folder_path(checkpoints: Checkpoints, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(checkpoints.sharded, copy)

    assert _fingerprint(copy, "sampled") == _fingerprint(checkpoints.sharded, "sampled")


@pytest.mark.parametrize("name", [SMALL_TENSOR, "embed.weight"], ids=["small", "large"])
def test_zeroed_tensor_changes_sampled_but_not_layout(
    checkpoints: Checkpoints, tmp_path: Path, name: str
) -> None:
    edited = tmp_path / "edited"
    shard = copy_with_zeroed_tensor(checkpoints.sharded, edited, name)

    layout_before = _fingerprint(checkpoints.sharded, "layout")
    layout_after = _fingerprint(edited, "layout")
    sampled_before = _fingerprint(checkpoints.sharded, "sampled")
    sampled_after = _fingerprint(edited, "sampled")

    assert layout_after == layout_before
    assert sampled_after.digest != sampled_before.digest
    assert sampled_after.differing(sampled_before) == [f"checkpoint/{shard}"]
    assert sampled_after.components["layout"] == sampled_before.components["layout"]


def test_levels_are_distinct_identities(checkpoints: Checkpoints) -> None:
    layout = _fingerprint(checkpoints.sharded, "layout")
    sampled = _fingerprint(checkpoints.sharded, "sampled")

    assert (layout.level, sampled.level) == ("layout", "sampled")
    assert sampled.differing(layout) == [
        f"checkpoint/{SHARD_1}",
        f"checkpoint/{SHARD_2}",
        "format",
    ]


def test_recipe_and_placement_are_their_own_components(checkpoints: Checkpoints) -> None:
    checkpoint = weightcache.open_checkpoint(checkpoints.sharded)
    base = weightcache.compute_fingerprint(
        checkpoint, weightcache.Recipe(), weightcache.Placement()
    )
    cast = weightcache.compute_fingerprint(
        checkpoint, weightcache.Recipe(dtype="F16"), weightcache.Placement()
    )
    replicated = weightcache.Recipe(tp_plan=weightcache.TPPlan((("*", "replicate"),)))
    rank0, rank1 = (
        weightcache.compute_fingerprint(checkpoint, replicated, weightcache.Placement(rank, 2))
        for rank in (0, 1)
    )

    assert cast.differing(base) == ["recipe"]
    assert rank1.differing(rank0) == ["placement"]


# -- a shard rewritten while the disk path reads it (issue 9, item 2) -----------------


def _open_fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def test_load_from_disk_refuses_a_shard_rewritten_while_it_is_read(
    checkpoints: Checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    folder = tmp_path / "model"
    shutil.copytree(checkpoints.sharded, folder)
    pause = tmp_path / "pause"
    pause.mkdir()
    recipe = weightcache.Recipe(plugins=(weightcache.PluginStep.parse(pause_step(pause)),))
    fds = _open_fds()

    with futures.ThreadPoolExecutor(1) as pool:
        loading = pool.submit(weightcache.load_from_disk, folder, recipe=recipe)
        wait_reached(pause, lambda: not loading.done())
        rewrite_data_in_place(folder / SHARD_2)
        (pause / "go").touch()
        with pytest.raises(weightcache.InvalidCheckpointError) as raised:
            loading.result(timeout=60)

    assert raised.value.reason == "INVALID_CHECKPOINT"
    assert f"{SHARD_2}: the file changed while it was being loaded" in str(raised.value)
    assert _open_fds() == fds  # the shard files were closed
