"""The fingerprint test vectors (docs/fingerprint.md): this package's code and an
independent JavaScript implementation both give every one."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import rfc8785

from weightcache.core.checkpoint import open_checkpoint
from weightcache.core.fingerprint import FORMAT, LEVELS, compute_fingerprint
from weightcache.core.recipe import Placement, Recipe
from weightcache.core.tp import TPPlan

VECTORS = Path(__file__).parent / "vectors"
DOC: dict[str, Any] = json.loads((VECTORS / "vectors.json").read_text(encoding="utf-8"))


def _recipe(given: dict[str, Any]) -> Recipe:
    assert given["plugins"] == []  # no vector has a plugin step
    plan = given["tp_plan"]
    rules = tuple((pattern, style) for pattern, style in plan) if plan is not None else None
    return Recipe(dtype=given["dtype"], tp_plan=TPPlan(rules) if rules is not None else None)


def _id(vector: dict[str, Any]) -> str:
    return f"{vector['case']}-{vector['level']}"


def test_the_vectors_are_of_this_format_and_cover_every_level() -> None:
    cases = {v["case"] for v in DOC["vectors"]}

    assert DOC["format"] == FORMAT
    assert cases == {"single", "file", "sharded", "unicode", "names", "hub", "recipe"}
    assert sorted((v["case"], v["level"]) for v in DOC["vectors"]) == sorted(
        (case, level) for case in cases for level in LEVELS
    )


@pytest.mark.parametrize("vector", DOC["vectors"], ids=_id)
def test_the_code_gives_every_vector(vector: dict[str, Any]) -> None:
    placement = Placement(**vector["placement"])

    with open_checkpoint(VECTORS / vector["path"]) as checkpoint:
        fp = compute_fingerprint(checkpoint, _recipe(vector["recipe"]), placement, vector["level"])

    assert fp.digest == vector["digest"]
    assert fp.components == {n: c["digest"] for n, c in vector["components"].items()}
    for name, component in vector["components"].items():
        value = json.loads(component["jcs"])
        assert rfc8785.dumps(value).decode() == component["jcs"], name
        assert hashlib.sha256(component["jcs"].encode()).hexdigest() == component["digest"]


def test_jcs_orders_members_by_utf16_not_by_code_point() -> None:
    """The unicode vector's two shards sort one way as files (UTF-8, the layout array) and
    the other way as JCS member names (UTF-16): 😀 is U+1F600 but D83D DE00 in UTF-16."""
    vector = next(v for v in DOC["vectors"] if v["case"] == "unicode")
    shards = [s["name"] for s in json.loads(vector["components"]["layout"]["jcs"])]
    members = [n.removeprefix("checkpoint/") for n in vector["components"] if "/" in n]

    assert shards == sorted(shards) == ["modèle-\uff4d.safetensors", "modèle-😀.safetensors"]
    ordered = json.loads(rfc8785.dumps({n: 0 for n in members}))
    assert list(ordered) == list(reversed(shards))


def test_an_independent_implementation_gives_every_vector() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("needs Node.js (node) for tests/vectors/check.mjs")

    done = subprocess.run(
        [node, str(VECTORS / "check.mjs")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    count = len(DOC["vectors"])
    assert done.stdout.splitlines()[-1] == f"{count} vectors, 0 failed"


def test_the_independent_implementation_fails_a_wrong_vector(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("needs Node.js (node) for tests/vectors/check.mjs")
    spoiled = json.loads(json.dumps(DOC))
    spoiled["vectors"][0]["digest"] = "0" * 64
    for case in ("single", "sharded", "unicode", "names", "hub"):
        (tmp_path / case).symlink_to(VECTORS / case)
    (tmp_path / "vectors.json").write_text(json.dumps(spoiled, ensure_ascii=False))

    done = subprocess.run(
        [node, str(VECTORS / "check.mjs"), str(tmp_path / "vectors.json")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 1
    assert done.stdout.splitlines()[-1] == f"{len(DOC['vectors'])} vectors, 1 failed"
