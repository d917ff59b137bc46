"""Identity of (checkpoint, recipe, placement), computed the same way on both sides.

The normative definition is ``docs/fingerprint.md`` (format ``weightcache.fingerprint/2``),
checked against the test vectors of ``tests/vectors/`` by this code and by an independent
implementation. In short: ``digest = sha256(JCS({component name: component digest}))``
where each component digest is the sha256 of that component's JSON canonicalized by RFC
8785 (JCS, the ``rfc8785`` package). Components: ``format``, ``layout`` (every shard's
name, size and header digest: what tells the daemon that a request is *about* a model it
holds), one ``checkpoint/<shard>`` per shard file, ``recipe`` and ``placement``. Keeping
them apart lets a mismatch say which one differs.

Content levels (the checkpoint part):

- ``layout``: shard name, size and sha256 of the raw header. Blind to a fine-tune.
- ``sampled``: layout plus, per tensor, its first, middle and last 64 bytes (every byte
  when the tensor is at most 192 bytes): O(tensors) small reads. Misses an edit between
  the samples.
- ``full`` (default): layout plus the sha256 of every byte of each shard, remembered on
  disk by file identity (:mod:`weightcache.core.hashcache`). A worker whose files are the
  ones its daemon loaded reads none of them (an Acquire by file identity).
"""

from __future__ import annotations

# rfc8785 sorts members by their UTF-16 code units (str.encode("utf-16-be")), whose codec
# Python imports on first use: imported here, a worker's first load() does not pay it.
import encodings.utf_16_be  # noqa: F401
import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import rfc8785

from weightcache.core.hashcache import cached_sha256, fd_sha256
from weightcache.core.levels import DEFAULT_LEVEL, LEVELS, Level

# Their home is core.levels; importers of the fingerprint code find them here too.
__all__ = [
    "DEFAULT_LEVEL",
    "FORMAT",
    "LEVELS",
    "REQUEST_COMPONENTS",
    "SAMPLE_BYTES",
    "Fingerprint",
    "Level",
    "cached_digests",
    "compute_fingerprint",
    "pending_fingerprint",
    "request_components",
]

if TYPE_CHECKING:
    # Imported for annotations only: the levels and the Fingerprint value import no torch,
    # so the CLI's argument parser can name them.
    from weightcache.core.checkpoint import Checkpoint, ShardInfo
    from weightcache.core.recipe import Pipeline, Placement, Recipe

#: The spec version (``docs/fingerprint.md``), inside the ``format`` component: a change of
#: algorithm is then a mismatch of that component, never a silent one.
FORMAT = "weightcache.fingerprint/2"
SAMPLE_BYTES = 64


@dataclass(frozen=True)
class Fingerprint:
    """A computed fingerprint.

    Attributes:
        digest: lowercase hex sha256 (64 characters); empty while :attr:`pending`.
        level: the checkpoint content level.
        components: component name -> lowercase hex sha256, sorted by name.
    """

    digest: str
    level: Level
    components: dict[str, str]

    @property
    def pending(self) -> bool:
        """Whether this is a daemon's fingerprint of a model still loading at level
        ``full`` whose shards it hashes as it reads them (:func:`pending_fingerprint`):
        no digest, no ``checkpoint/<shard>`` components yet."""
        return not self.digest

    def may_become(self, other: Fingerprint) -> bool:
        """Whether ``other`` agrees with every component this fingerprint has: for a
        :attr:`pending` one, whether it may turn out to be ``other`` once hashed."""
        return self.level == other.level and all(
            other.components.get(name) == digest for name, digest in self.components.items()
        )

    def differing(self, other: Fingerprint) -> list[str]:
        """Names of the components that differ from (or are missing in) ``other``, sorted."""
        names = set(self.components) | set(other.components)
        return sorted(n for n in names if self.components.get(n) != other.components.get(n))

    def same_layout(self, other: Fingerprint) -> bool:
        """Whether ``other`` has the same ``layout`` component (shard names, sizes and
        headers): a request about this checkpoint, whatever else differs."""
        return self.components.get("layout") == other.components.get("layout")


def compute_fingerprint(
    checkpoint: Checkpoint,
    recipe: Recipe | Pipeline,
    placement: Placement,
    level: Level = DEFAULT_LEVEL,
    *,
    file_sha256: Mapping[str, str] | None = None,
) -> Fingerprint:
    """Fingerprint a validated checkpoint under a recipe (or the pipeline already built
    from it for this checkpoint and placement) and a placement.

    Shards are read through the checkpoint's open descriptors (the same ones a load
    reads), so the fingerprint describes the bytes that are loaded as long as
    :meth:`Checkpoint.check_unchanged` passes after the load.

    Args:
        file_sha256: at level ``full``, shard name -> the lowercase hex sha256 of every
            byte of that shard, already computed by the caller from the same descriptor
            (the daemon hashes a shard while it loads it); other shards are hashed here.

    Raises:
        ValueError: ``level`` is not ``"layout"``, ``"sampled"`` or ``"full"``.
        RecipeError: the recipe cannot be built for this checkpoint.
        InvalidCheckpointError: the checkpoint is closed.
        OSError: a shard cannot be read.
    """
    from weightcache.core.recipe import Recipe

    if isinstance(recipe, Recipe):
        recipe = recipe.build(checkpoint, placement)
    components = _known_components(checkpoint, recipe, placement, level)
    identities = _shard_identities(checkpoint, level, file_sha256 or {})
    for shard, identity in zip(checkpoint.shards, identities, strict=True):
        components[f"checkpoint/{shard.name}"] = _digest(identity)
    components = dict(sorted(components.items()))
    return Fingerprint(digest=_digest(components), level=level, components=components)


def pending_fingerprint(
    checkpoint: Checkpoint, pipeline: Pipeline, placement: Placement
) -> Fingerprint:
    """What a daemon knows of a level-``full`` fingerprint before it has read the shards:
    the ``format``, ``layout``, ``recipe`` and ``placement`` components, no digest
    (:attr:`Fingerprint.pending`). The daemon hashes the shards while it loads them and
    then replaces it with :func:`compute_fingerprint`'s (``docs/fingerprint.md``,
    "Who reads the bytes")."""
    components = dict(sorted(_known_components(checkpoint, pipeline, placement, "full").items()))
    return Fingerprint(digest="", level="full", components=components)


def cached_digests(checkpoint: Checkpoint) -> dict[str, str]:
    """Shard name -> sha256, for the shards whose digest the hash cache holds for their
    identity as opened (:func:`weightcache.core.hashcache.cached_sha256`); a shard missing
    here is one a level-``full`` fingerprint would read in full. Pass it on as
    :func:`compute_fingerprint`'s ``file_sha256``.

    Raises:
        InvalidCheckpointError: the checkpoint is closed.
    """
    found = {s.name: cached_sha256(checkpoint.fd(s.name)) for s in checkpoint.shards}
    return {name: digest for name, digest in found.items() if digest is not None}


def _known_components(
    checkpoint: Checkpoint, pipeline: Pipeline, placement: Placement, level: Level
) -> dict[str, str]:
    components = request_components(pipeline.identity, placement, level)
    layout = [
        {"name": shard.name, "size": shard.size, "header_sha256": shard.header_sha256}
        for shard in checkpoint.shards
    ]
    components["layout"] = _digest(layout)
    return components


#: The components :func:`request_components` computes: those that read no checkpoint file.
REQUEST_COMPONENTS = ("format", "placement", "recipe")


def request_components(
    recipe_identity: dict[str, Any], placement: Placement, level: Level
) -> dict[str, str]:
    """The ``format``, ``placement`` and ``recipe`` components (name -> digest, sorted),
    which need no byte of the checkpoint: what an Acquire by file identity sends
    (``Recipe.identity`` gives ``recipe_identity`` from the checkpoint folder alone).

    Raises:
        ValueError: ``level`` is not ``"layout"``, ``"sampled"`` or ``"full"``.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown fingerprint level {level!r}; use one of {LEVELS}")
    parts = {
        "format": {"format": FORMAT, "level": level},
        "placement": placement.identity(),
        "recipe": recipe_identity,
    }
    return {name: _digest(value) for name, value in parts.items()}


def _digest(value: Any) -> str:
    """Lowercase hex sha256 of ``value`` serialized by RFC 8785 (JSON Canonicalization
    Scheme): keys sorted by UTF-16 code units, no whitespace, strings as ECMAScript
    ``JSON.stringify`` writes them (non-ASCII characters as themselves, in UTF-8)."""
    return hashlib.sha256(rfc8785.dumps(value)).hexdigest()


def _shard_identities(
    checkpoint: Checkpoint, level: Level, known: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Each shard's identity, in shard order. At ``full`` the shards are hashed in parallel
    threads (hashlib and ``pread`` release the GIL on large buffers): a first hash of a
    many-shard checkpoint takes about its largest shard's time on as many cores. Digests
    the hash cache holds are looked up first: threads only for shards to hash (starting
    and joining a pool took about 1 ms of a 100-tensor disk load, all digests cached)."""
    shards = checkpoint.shards
    if level == "full":
        known = {**cached_digests(checkpoint), **known}
    if level != "full" or sum(shard.name not in known for shard in shards) < 2:
        return [_shard_identity(checkpoint, shard, level, known) for shard in shards]
    workers = min(len(shards), os.cpu_count() or 1)
    with ThreadPoolExecutor(workers, thread_name_prefix="weightcache-hash") as pool:
        return list(
            pool.map(lambda shard: _shard_identity(checkpoint, shard, level, known), shards)
        )


def _shard_identity(
    checkpoint: Checkpoint, shard: ShardInfo, level: Level, known: Mapping[str, str]
) -> dict[str, Any]:
    identity: dict[str, Any] = {
        "name": shard.name,
        "size": shard.size,
        "header_sha256": shard.header_sha256,
    }
    if level == "sampled":
        identity["content_sha256"] = _sampled_digest(shard, checkpoint.fd(shard.name))
    elif level == "full":
        identity["file_sha256"] = known.get(shard.name) or fd_sha256(
            checkpoint.fd(shard.name), shard.path
        )
    return identity


def _sampled_digest(shard: ShardInfo, fd: int) -> str:
    digest = hashlib.sha256()
    for info in shard.tensors:
        digest.update(info.name.encode())
        for offset, length in _sample_ranges(info.begin, info.nbytes):
            digest.update(os.pread(fd, length, offset))
    return digest.hexdigest()


def _sample_ranges(begin: int, nbytes: int) -> list[tuple[int, int]]:
    if nbytes <= 3 * SAMPLE_BYTES:
        return [(begin, nbytes)] if nbytes else []
    middle = begin + (nbytes - SAMPLE_BYTES) // 2
    end = begin + nbytes - SAMPLE_BYTES
    return [(begin, SAMPLE_BYTES), (middle, SAMPLE_BYTES), (end, SAMPLE_BYTES)]
