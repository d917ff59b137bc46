"""Demo jobs: one way of getting a model's weights each, run in a forked worker process.

``demo/fleet.py`` forks a worker per job from a parent that has already imported torch,
transformers, safetensors and weightcache (imports are not timed: they cost every loader
the same), and calls :func:`run_job` in it. The loaders, each as its user writes it:

- ``cache``: ``BertModel`` built on the ``meta`` device (nothing allocated or
  initialised), then ``weightcache.load_into`` attaches the daemon's tensors (zero-copy);
- ``load_file``: ``BertModel(config)`` (allocated and randomly initialised), then
  ``model.load_state_dict(safetensors.torch.load_file(path))``;
- ``from_pretrained``: ``transformers.BertModel.from_pretrained(folder)``;
- ``disk``: the cache's worker without a daemon: ``weightcache.load_from_disk`` and the
  tensors assigned to the meta model (what ``load``'s fallback does).

With ``dtype="BF16"`` each produces a bfloat16 model: the cache attaches the daemon's
cast (``Recipe(dtype="BF16")``, made once at preload), the others cast in the worker.

For a checkpoint of many small tensors (no model) the jobs are ``weightcache.load``,
``safetensors.torch.load_file`` and ``weightcache.load_from_disk``, each followed by
reading the first byte of every tensor.

Times are seconds from the job's start (after the fork); embeddings are float32.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file
from torch.nn import functional

import weightcache
from weightcache._module import assign

SENTENCES = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "A cheetah is running behind its prey.",
    "Shared memory lets a restarted worker skip reading its weights from disk.",
)
MODEL_SOURCES = ("cache", "load_file", "from_pretrained", "disk")
MANY_SOURCES = ("cache", "load_file", "disk")
TORCH_DTYPE = {"F32": torch.float32, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class Job:
    """What one worker does.

    Attributes:
        source: one of :data:`MODEL_SOURCES` (``kind="model"``) or :data:`MANY_SOURCES`
            (``kind="many"``).
        kind: ``model`` (the MiniLM, embedded), ``many`` (the many-tensor checkpoint) or
            ``idle`` (nothing loaded: the memory baseline).
        path: the checkpoint folder.
        socket: the daemon's socket (for ``cache``).
        dtype: ``F32`` or ``BF16``: the dtype of the model the worker ends with.
    """

    source: str
    kind: str
    path: str
    socket: str
    dtype: str = "F32"


@dataclass
class Result:
    """What a worker reports, times in seconds from its start.

    Attributes:
        ready_s: weights in the model (``many``: the load call returned).
        embed_s: first embedding computed (``many``: every tensor's first byte read).
        got: where the weights came from (``cache``, ``disk``: weightcache's ``source``;
            the other loaders' name).
        fallback: weightcache's fallback reason, ``""`` when none.
        embeddings: the sentence embeddings, float32 (``model`` jobs).
    """

    ready_s: float
    embed_s: float
    got: str
    fallback: str = ""
    embeddings: torch.Tensor | None = None
    keep: list[Any] = field(default_factory=list, repr=False)


def warm_imports() -> None:
    """Import what the jobs use lazily (transformers' BERT modules and tokenizer,
    weightcache's loader), so that forked workers find it imported: imports are not
    timed, and each loader would otherwise pay its own at its first use."""
    for name in ("BertConfig", "BertModel", "AutoTokenizer", "BertTokenizerFast"):
        getattr(transformers, name)
    for name in ("load", "load_into", "load_from_disk", "Recipe"):
        getattr(weightcache, name)


def _meta_model(folder: str, dtype: torch.dtype) -> transformers.BertModel:
    config = transformers.BertConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.BertModel(config)
    torch.nn.Module.to(model, dtype)  # in place
    return model


def _load_model(job: Job, result_keep: list[Any]) -> tuple[torch.nn.Module, str, str]:
    """The model with its weights, where they came from and the fallback reason."""
    dtype = TORCH_DTYPE[job.dtype]
    if job.source == "from_pretrained":
        model = transformers.BertModel.from_pretrained(job.path, dtype=dtype)
        return model, job.source, ""
    if job.source == "load_file":
        config = transformers.BertConfig.from_pretrained(job.path)
        model = transformers.BertModel(config)
        torch.nn.Module.to(model, dtype)  # in place
        state = load_file(str(Path(job.path) / "model.safetensors"))
        # Not strict: the checkpoint also holds embeddings.position_ids, which today's
        # BertModel keeps as a buffer that is not saved. Every weight must be there.
        missing = model.load_state_dict(state, strict=False).missing_keys
        if missing:
            raise RuntimeError(f"load_state_dict: missing {missing}")
        return model, job.source, ""
    model = _meta_model(job.path, dtype)
    recipe = weightcache.Recipe(dtype=job.dtype) if job.dtype != "F32" else None
    if job.source == "cache":
        weights = weightcache.load_into(model, job.path, socket=job.socket, recipe=recipe)
    else:
        weights = weightcache.load_from_disk(job.path, recipe=recipe)
        assign(model, weights.tensors)
    # Nothing to patch: the buffer the checkpoint lacks (embeddings.token_type_ids) is
    # computed by BertModel's own _init_weights in load_into/assign.
    result_keep.append(weights)  # the lease lives as long as the worker holds the model
    reason = weights.fallback_reason
    return model, weights.source, f"{reason.code}: {reason.detail}" if reason else ""


def embed(model: torch.nn.Module, folder: str) -> torch.Tensor:
    """Sentence embeddings of :data:`SENTENCES` as sentence-transformers computes them for
    this model (token states averaged over the attention mask, L2-normalised), float32,
    shape (sentences, hidden size)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(list(SENTENCES), padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    return functional.normalize(pooled, p=2, dim=1)


def _first_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Read the first byte of every tensor (as the benchmarks do); their sum."""
    return sum(int(t.view(-1)[:1].view(torch.uint8)[0]) for t in tensors.values() if t.numel())


def run_job(job: Job) -> Result:
    """Do the job; the result holds the model and its lease (``keep``) until dropped."""
    start = time.perf_counter()
    keep: list[Any] = []
    if job.kind == "idle":  # the memory baseline: the process and its imports alone
        return Result(0.0, 0.0, "idle")
    if job.kind == "model":
        model, got, fallback = _load_model(job, keep)
        model.eval()
        ready = time.perf_counter() - start
        embeddings = embed(model, job.path)
        keep.append(model)
        return Result(ready, time.perf_counter() - start, got, fallback, embeddings, keep)
    fallback = ""
    if job.source == "load_file":
        files = sorted(Path(job.path).glob("*.safetensors"))
        tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
        got = job.source
    else:
        if job.source == "cache":
            weights = weightcache.load(job.path, socket=job.socket)
        else:
            weights = weightcache.load_from_disk(job.path)
        tensors, got = weights.tensors, weights.source
        reason = weights.fallback_reason
        fallback = f"{reason.code}: {reason.detail}" if reason else ""
        keep.append(weights)
    ready = time.perf_counter() - start
    _first_bytes(tensors)
    keep.append(tensors)
    return Result(ready, time.perf_counter() - start, got, fallback, None, keep)
