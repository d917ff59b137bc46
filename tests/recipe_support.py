"""Helpers for the recipe, checkpoint-layout and property tests.

Built on :mod:`tests.support` (real daemons on real sockets): what this adds is

- an environment for children: the example plugins of ``tests/plugins`` on ``PYTHONPATH``,
  a private ``$WEIGHTCACHE_HASH_CACHE``, Hugging Face offline (:func:`children_env`);
- :class:`RecipeWorker`: ``tests/recipe_worker.py`` in its own interpreter, which takes
  recipes (dtype, tensor-parallel plan or plan file, plugin steps) as JSON and can build a
  ``transformers`` module to ``load_into``;
- writers for sharded checkpoints and the Hugging Face hub-cache layout, and a Preload
  helper.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import weightcache
import weightcache.core.hashcache
from tests.support import service_stub
from weightcache.testing import INDEX_FILE, METADATA, SINGLE_FILE, Daemon, DaemonPool, Worker
from weightcache.v1 import weight_cache_service_pb2 as pb

TESTS = Path(__file__).resolve().parent
PLUGINS = TESTS / "plugins"
RECIPE_WORKER = TESTS / "recipe_worker.py"


# -- environment ---------------------------------------------------------------------


def children_env(hash_cache: Path) -> dict[str, str]:
    """Variables for daemons and workers of these tests: the example plugins importable,
    full-fingerprint hashes cached in ``hash_cache``, Hugging Face offline."""
    path = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": str(PLUGINS) + (os.pathsep + path if path else ""),
        "WEIGHTCACHE_HASH_CACHE": str(hash_cache),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


@contextlib.contextmanager
def environ(extra: Mapping[str, str]) -> Iterator[None]:
    """Set ``extra`` in ``os.environ`` for the block (children started in it inherit
    them through :func:`weightcache.testing.child_env`), then restore what was there."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


#: Seconds a recipe worker may take to answer (its first command may import transformers).
WORKER_TIMEOUT = 180.0
#: pytest-timeout for the tests of these modules: their module fixtures start several
#: daemons and import transformers, which takes minutes on a loaded 2-CPU machine.
TEST_TIMEOUT = 400


def start_daemons(
    pool: DaemonPool, env: Mapping[str, str], specs: Mapping[str, Sequence[str]]
) -> dict[str, Daemon]:
    """Start several daemons at once (``name -> preload arguments``) with ``env`` added to
    their environment, without waiting: their start-ups (torch imports, preloads) overlap.
    Wait with :func:`wait_ready`."""
    with environ(env):
        return {name: pool.start(args=list(argv), wait=False) for name, argv in specs.items()}


def wait_ready(daemons: Iterable[Daemon]) -> None:
    """Wait until every daemon is ready (each within the harness's ``READY_TIMEOUT``)."""
    for daemon in daemons:
        daemon.wait_ready()


# -- workers -------------------------------------------------------------------------


class RecipeWorker(Worker):
    """``tests/recipe_worker.py`` in its own interpreter (the harness's worker protocol,
    other commands), started with ``env`` added to its environment."""

    def __init__(self, log_path: Path, env: Mapping[str, str]) -> None:
        super().__init__(log_path, [sys.executable, str(RECIPE_WORKER)], env)

    def load(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        key: str = "w",
        recipe: Mapping[str, Any] | None = None,
        hub: Mapping[str, str] | None = None,
        dump: Path | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``weightcache.load(path, recipe=..., **kwargs)`` in the worker, kept under
        ``key``. ``recipe`` as :func:`recipe_json` makes it; ``hub`` (``cache_root``,
        ``repo_id``, ``revision``) resolves the path with ``weightcache.hub_snapshot``
        in the worker; ``dump`` saves the tensors it got to that safetensors file."""
        return self.request(
            "load",
            timeout=WORKER_TIMEOUT,
            key=key,
            path=None if path is None else str(path),
            hub=None if hub is None else dict(hub),
            recipe=None if recipe is None else dict(recipe),
            kwargs=kwargs,
            dump=None if dump is None else str(dump),
        )

    def module(
        self,
        kind: str,
        path: str | os.PathLike[str],
        dump: Path,
        *,
        key: str = "m",
        torch_dtype: str | None = None,
        pretrained: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """In the worker: build a ``kind`` (``bert`` or ``llama``) module from the folder's
        config, ``weightcache.load_into`` it (``kwargs``: socket, ...), and build a second
        one from ``load_from_disk`` + ``weightcache._module.assign`` with the same dtype;
        run both forward and save ``{"cache": out, "disk": out}`` to ``dump`` (with
        ``pretrained``, also ``"pretrained"``: transformers' ``from_pretrained``)."""
        return self.request(
            "module",
            timeout=WORKER_TIMEOUT,
            key=key,
            kind=kind,
            path=str(path),
            torch_dtype=torch_dtype,
            pretrained=pretrained,
            kwargs=kwargs,
            dump=str(dump),
        )

    def close_all(self) -> None:
        """Close everything the worker loaded (releasing its leases)."""
        reply = self.request("close_all")
        assert reply["ok"], reply


class RecipeWorkerPool:
    """Recipe workers of one fixture; :meth:`close` ends them all."""

    def __init__(self, log_dir: Path, env: Mapping[str, str]) -> None:
        self.log_dir = log_dir
        self.env = dict(env)
        self.workers: list[RecipeWorker] = []

    def start(self) -> RecipeWorker:
        worker = RecipeWorker(self.log_dir / f"recipe-worker-{len(self.workers)}.log", self.env)
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def recipe_json(
    *,
    dtype: str | None = None,
    tp_plan: Mapping[str, str] | None = None,
    tp_plan_file: str | os.PathLike[str] | None = None,
    plugins: Sequence[str] = (),
) -> dict[str, Any]:
    """A recipe as the worker takes it: ``tp_plan`` becomes ``TPPlan.from_mapping``,
    ``tp_plan_file`` ``TPPlan.from_json``, each plugin ``PluginStep.parse``."""
    return {
        "dtype": dtype,
        "tp_plan": None if tp_plan is None else dict(tp_plan),
        "tp_plan_file": None if tp_plan_file is None else str(tp_plan_file),
        "plugins": list(plugins),
    }


# -- daemon RPCs ---------------------------------------------------------------------


def preload(
    socket: str,
    path: str | os.PathLike[str],
    *,
    dtype: str = "",
    tp_rules: Sequence[tuple[str, str]] = (),
    plugins: Sequence[tuple[str, Mapping[str, str]]] = (),
    tp_rank: int = 0,
    tp_size: int = 1,
    level: int = pb.FINGERPRINT_LEVEL_UNSPECIFIED,
) -> list[pb.PreloadResponse]:
    """Run a remote Preload stream to its end."""
    request = pb.PreloadRequest(
        path=str(path),
        recipe=pb.Recipe(
            dtype=dtype,
            tp_rules=[pb.TensorParallelRule(pattern=p, style=s) for p, s in tp_rules],
            plugins=[pb.RecipePlugin(name=n, params=dict(params)) for n, params in plugins],
        ),
        placement=pb.Placement(tp_rank=tp_rank, tp_size=tp_size),
        # pb.FINGERPRINT_LEVEL_* are plain ints at run time, and a proto3 enum field takes
        # any int; the generated stub types the field as the FingerprintLevel wrapper.
        fingerprint_level=level,  # type: ignore[arg-type]
    )
    with service_stub(socket) as stub:
        return list(stub.Preload(request, timeout=60))


def list_models(socket: str) -> list[pb.Model]:
    with service_stub(socket) as stub:
        return list(stub.ListModels(pb.ListModelsRequest(), timeout=10).models)


def evict(socket: str, name: str) -> None:
    with service_stub(socket) as stub:
        stub.Evict(pb.EvictRequest(name=name), timeout=10)


# -- checkpoints ---------------------------------------------------------------------

LLAMA_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    # Not 64, so that a split of dim 0 and one of dim 1 give different shapes everywhere.
    "intermediate_size": 96,
    "max_position_embeddings": 64,
}


def build_llama(folder: Path, *, seed: int, max_shard_size: str | None, tie: bool) -> Path:
    """A seeded tiny ``LlamaForCausalLM`` saved by ``save_pretrained``; returns ``folder``."""
    import transformers

    config = transformers.LlamaConfig(**LLAMA_CONFIG, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return folder


def write_shards(
    folder: Path,
    shards: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    metadata: Mapping[str, str] = METADATA,
    index: bool = True,
) -> Path:
    """Write ``folder`` with one safetensors file per ``shards`` entry (file name ->
    tensors) and, with ``index``, ``model.safetensors.index.json``; returns ``folder``."""
    folder.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for file, tensors in shards.items():
        save_file(dict(tensors), str(folder / file), metadata=dict(metadata))
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if index:
        doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(doc))
    else:
        assert list(shards) == [SINGLE_FILE], shards
    return folder


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class HubRepo:
    """A model in a Hugging Face hub cache.

    Attributes:
        cache_root: the cache folder (``HF_HUB_CACHE``).
        repo_id: ``org/name``.
        commit: the snapshot's commit hash; ``refs/main`` names it.
        snapshot: ``cache_root/models--org--name/snapshots/<commit>``.
        blobs: file name in the snapshot -> its blob path.
    """

    cache_root: Path
    repo_id: str
    commit: str
    snapshot: Path
    blobs: dict[str, Path]


def write_hub_repo(
    cache_root: Path,
    repo_id: str,
    source: Path,
    commit: str,
    blob_name: Mapping[str, str] | None = None,
) -> HubRepo:
    """Lay ``source``'s files out as ``huggingface_hub`` caches them: each in
    ``blobs/<sha256 of its bytes>`` (or ``blob_name[file]``), the snapshot holding relative
    symlinks ``../../blobs/<name>``, and ``refs/main`` holding ``commit``."""
    repo = cache_root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    blobs = {}
    for file in sorted(os.listdir(source)):
        name = (blob_name or {}).get(file) or file_sha256(source / file)
        blob = repo / "blobs" / name
        shutil.copyfile(source / file, blob)
        (snapshot / file).symlink_to(Path("..", "..", "blobs", name))
        blobs[file] = blob
    return HubRepo(cache_root, repo_id, commit, snapshot, blobs)


class HashCounter:
    """Wraps ``weightcache.core.hashcache._hash``: the files actually read.

    Shards are hashed in parallel threads, so the order of reads is not
    defined: :meth:`take` returns the names sorted.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read: list[str] = []
        real = weightcache.core.hashcache._hash

        def counting(fd: int, path: Path, stop: threading.Event | None = None) -> str:
            self.read.append(os.path.basename(path))
            digest: str = real(fd, path, stop)
            return digest

        monkeypatch.setattr(weightcache.core.hashcache, "_hash", counting)

    def take(self) -> list[str]:
        """The base names read since the last call, sorted (repeats kept)."""
        read, self.read = self.read, []
        return sorted(read)
