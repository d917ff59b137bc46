"""Write the fingerprint test vectors: small checkpoints and ``vectors.json``.

Run ``.venv/bin/python tests/vectors/generate.py`` only when the fingerprint format
changes (``docs/fingerprint.md``, "Versioning"): the checkpoints are committed, and
``tests/test_vectors.py`` checks that the code still gives every committed vector. The
values are deterministic (no random numbers), so a rerun writes the same bytes with the
same safetensors version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import rfc8785
import torch
from safetensors.torch import save_file

from weightcache.core.checkpoint import INDEX_FILE, open_checkpoint
from weightcache.core.fingerprint import FORMAT, LEVELS, Level, compute_fingerprint
from weightcache.core.recipe import Placement, Recipe
from weightcache.core.tp import TPPlan

HERE = Path(__file__).parent
#: The hub case: ``models--acme--tiny`` at this commit.
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"
#: Shard names whose UTF-16 order (😀 first: U+D83D < U+FF4D) differs from their code
#: point and UTF-8 order (U+FF4D, a fullwidth m, first): the component names sort one way
#: in JCS, the shards the other way in ``layout``.
UNICODE_SHARDS = ("modèle-\uff4d.safetensors", "modèle-😀.safetensors")
#: Shard names that JCS must escape: a control character and a quote.
ESCAPED_SHARDS = ("a\x01.safetensors", 'b"q.safetensors')


def _ramp(shape: tuple[int, ...], dtype: torch.dtype, start: int = 0) -> torch.Tensor:
    count = 1
    for size in shape:
        count *= size
    values = (torch.arange(count, dtype=torch.float64) + start) % 251 - 125
    if dtype == torch.bool:
        return (values > 0).reshape(shape)
    if dtype == torch.uint8:
        return (values + 125).to(torch.uint8).reshape(shape)
    return (values / 8).to(dtype).reshape(shape)


def _single_tensors() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": _ramp((16, 8), torch.float32),
        "norm.weight": _ramp((8,), torch.bfloat16, 3),
        "ids": torch.tensor([[1, -2], [3, -4]], dtype=torch.int64),
        "mask": _ramp((5,), torch.bool),
        "scale": _ramp((4,), torch.float8_e4m3fn, 7),
        "empty": torch.zeros((0, 4), dtype=torch.float32),
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "bytes": _ramp((1000,), torch.uint8, 11),
    }


def _write_index(folder: Path, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    index = {"metadata": {"total_size": 0}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, ensure_ascii=False) + "\n")


def write_checkpoints() -> None:
    """(Re)write every case's folder under this one."""
    for case in ("single", "sharded", "unicode", "names", "hub"):
        shutil.rmtree(HERE / case, ignore_errors=True)
    single = HERE / "single"
    single.mkdir()
    save_file(
        _single_tensors(),
        str(single / "model.safetensors"),
        metadata={"format": "pt"},  # one key: safetensors writes a map in no fixed order
    )
    _write_sharded(
        HERE / "sharded",
        {
            "model-00001-of-00002.safetensors": {
                "layers.0.proj.weight": _ramp((8, 6), torch.float32),
                "layers.0.proj.bias": _ramp((6,), torch.float32, 1),
            },
            "model-00002-of-00002.safetensors": {
                "layers.1.proj.weight": _ramp((8, 6), torch.bfloat16, 2),
                "layers.1.proj.bias": _ramp((6,), torch.float16, 3),
            },
        },
    )
    _write_sharded(
        HERE / "unicode",
        {
            UNICODE_SHARDS[0]: {
                "日本語.weight": _ramp((4, 4), torch.float32),
                "é": _ramp((3,), torch.float16),
            },
            UNICODE_SHARDS[1]: {
                "😀.bias": _ramp((2,), torch.float32, 5),
                'zé\\"q': _ramp((1,), torch.int64),
            },
        },
    )
    # Integer-like tensor names: ECMAScript's JSON.parse would list them first, ascending.
    _write_sharded(
        HERE / "names",
        {
            ESCAPED_SHARDS[0]: {
                "10": _ramp((70,), torch.float32),
                "2": _ramp((3,), torch.float32, 1),
            },
            ESCAPED_SHARDS[1]: {"x": _ramp((2,), torch.int64), "7": _ramp((60,), torch.float32, 2)},
        },
    )
    _write_hub(HERE / "hub")


def _write_sharded(folder: Path, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each shard file, then the index naming them."""
    folder.mkdir()
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file))
    _write_index(folder, shards)


def _write_hub(root: Path) -> None:
    repo = root / "models--acme--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / HUB_COMMIT
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    staged = root / "staged.safetensors"
    save_file({"w": _ramp((4, 2), torch.float16, 9), "b": _ramp((2,), torch.float32)}, str(staged))
    digest = hashlib.sha256(staged.read_bytes()).hexdigest()
    os.replace(staged, blobs / digest)
    (snapshot / "model.safetensors").symlink_to(Path("..", "..", "blobs", digest))


#: (case, folder relative to this one, recipe, placement)
CASES: list[tuple[str, str, Recipe, Placement]] = [
    ("single", "single", Recipe(), Placement()),
    ("file", "single/model.safetensors", Recipe(), Placement()),
    ("sharded", "sharded", Recipe(), Placement()),
    ("unicode", "unicode", Recipe(), Placement()),
    ("names", "names", Recipe(), Placement()),
    ("hub", f"hub/models--acme--tiny/snapshots/{HUB_COMMIT}", Recipe(), Placement()),
    (
        "recipe",
        "sharded",
        Recipe(
            dtype="F16",
            tp_plan=TPPlan(
                (("layers.*.proj.weight", "colwise"), ("layers.*.proj.bias", "colwise"))
            ),
        ),
        Placement(tp_rank=1, tp_size=2),
    ),
]


def _recipe_input(recipe: Recipe) -> dict[str, Any]:
    rules = recipe.tp_plan.rules if recipe.tp_plan is not None else None
    return {
        "dtype": recipe.dtype,
        "tp_plan": [list(rule) for rule in rules] if rules is not None else None,
        "plugins": [],
    }


def vectors() -> dict[str, Any]:
    """Every case at every level, computed by this package's code."""
    out = []
    for case, folder, recipe, placement in CASES:
        for level in LEVELS:
            with open_checkpoint(HERE / folder) as checkpoint:
                values = _component_values(checkpoint, recipe, placement, level)
                fp = compute_fingerprint(checkpoint, recipe, placement, level)
            components = {
                name: {"jcs": rfc8785.dumps(value).decode(), "digest": fp.components[name]}
                for name, value in sorted(values.items())
            }
            assert set(components) == set(fp.components)
            out.append(
                {
                    "case": case,
                    "path": folder,
                    "recipe": _recipe_input(recipe),
                    "placement": placement.identity(),
                    "level": level,
                    "components": components,
                    "digest": fp.digest,
                }
            )
    return {"format": FORMAT, "vectors": out}


def _component_values(
    checkpoint: Any, recipe: Recipe, placement: Placement, level: Level
) -> dict[str, Any]:
    """The value of each component before JCS, rebuilt from the spec for the record (the
    digests come from ``compute_fingerprint``; ``generate`` checks the two agree)."""
    from weightcache.core import fingerprint as fp_module

    pipeline = recipe.build(checkpoint, placement)
    shards = [
        {"name": s.name, "size": s.size, "header_sha256": s.header_sha256}
        for s in checkpoint.shards
    ]
    values: dict[str, Any] = {
        "format": {"format": FORMAT, "level": level},
        "layout": shards,
        "recipe": pipeline.identity,
        "placement": placement.identity(),
    }
    for shard in checkpoint.shards:
        values[f"checkpoint/{shard.name}"] = fp_module._shard_identity(checkpoint, shard, level, {})
    return values


def main() -> None:
    """Write the checkpoints, then ``vectors.json`` (checking each component's digest)."""
    write_checkpoints()
    doc = vectors()
    for vector in doc["vectors"]:
        for name, component in vector["components"].items():
            digest = hashlib.sha256(component["jcs"].encode()).hexdigest()
            assert digest == component["digest"], (vector["case"], vector["level"], name)
    text = json.dumps(doc, indent=1, ensure_ascii=False, sort_keys=False) + "\n"
    (HERE / "vectors.json").write_text(text, encoding="utf-8")
    print(f"wrote {len(doc['vectors'])} vectors to {HERE / 'vectors.json'}")


if __name__ == "__main__":
    main()
