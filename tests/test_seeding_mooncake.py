"""Seeding through Mooncake's transfer engine (issue 40, Build 1; ``--seed-plane mooncake``
on the seeder, ``--seed-mooncake`` on the peer): a daemon in namespace B fills a model
from the daemon in namespace A, the engine over TCP reading A's staging ring into B's
staging buffer, verified by content (docs/seeding.md, "Data plane").

Namespaces are made as root and removed after, as in ``tests/test_seeding.py`` (whose
helpers this reuses); without root or ``ip`` those are skipped, saying so. Mooncake itself
(the ``mooncake`` extra, and Debian's libibverbs1 that ``make seed-deps`` installs) is
required: without it :func:`test_the_transfer_engine_is_importable` fails, it never skips.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.security_support import Pki
from tests.test_seeding import (
    PORT,
    SEED_FAILED,
    Link,
    _events,
    _model,
    _model_digest,
    _nodes,
    _running,
    _seeding_args,
    _serving_args,
    _worker_in,
    link,
    netns_only,
    pki,
    room,
)
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache_service.mooncake_plane import NOT_OFFERED_WHY, check_available

__all__ = ["link", "pki", "room"]  # the fixtures, imported to be found here


def test_the_transfer_engine_is_importable() -> None:
    assert check_available() is None


def mooncake_mapped(pid: int) -> bool:
    """Whether process ``pid`` has mapped Mooncake's engine (``mooncake/engine.so``): its
    import, seen from outside (as ``tests/test_torch_free.py`` sees torch's)."""
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
        return any(line.rstrip().endswith(os.path.join("mooncake", "engine.so")) for line in maps)


def _serving(pki: Pki, link: Link, *extra: str) -> list[str]:
    return _serving_args(pki, link, "--tls-client-ca", str(pki.ca), "--allow-seeding", *extra)


@netns_only
def test_seeds_through_the_transfer_engine_from_a_peer_that_offers_it(
    room: Path, link: Link, pki: Pki
) -> None:
    # 20 MiB over one connection: four 5 MiB pieces, each two slots (4 MiB and 1 MiB), eight
    # ranges, twice the peer's ring (4 slots): each slot is staged again after the seeder
    # asked past it (the ask is the acknowledgement).
    a_node, b_node = _nodes(room, link, big=True, per_shard=10)
    seeding = [*_seeding_args(pki, link), "--seed-plane", "mooncake", "--seed-streams", "1"]
    with (
        _running(a_node, _serving(pki, link, "--seed-mooncake")) as a,
        _running(b_node, seeding) as b,
    ):
        model = _model(b)
        [seeded] = _events(b, "seeded")
        worker = _worker_in(b_node, b)  # bitwise against safetensors reading the files
        served = _events(a, "seed data connection refused")
        mapped = (mooncake_mapped(a.pid), mooncake_mapped(b.pid))

    peer = f"{link.a_ip}:{PORT}"
    assert (model.state, model.source) == (pb.MODEL_STATE_READY, f"peer {peer}")
    assert model.fingerprint.digest == _model_digest(a_node)
    assert (seeded["plane"], seeded["pieces"], seeded["dropped"]) == ("mooncake", {peer: 4}, {})
    assert seeded["bytes"] == model.size_bytes
    assert worker == {"source": "cache", "tensors": 20}
    assert _events(b, SEED_FAILED) == []  # no fallback to the files
    assert served == []
    assert mapped == (True, True)  # the engine, at both ends


@netns_only
def test_a_peer_without_it_is_named_and_the_files_loaded(room: Path, link: Link, pki: Pki) -> None:
    a_node, b_node = _nodes(room, link)
    seeding = [*_seeding_args(pki, link), "--seed-plane", "mooncake"]
    with _running(a_node, _serving(pki, link)) as a, _running(b_node, seeding) as b:
        model = _model(b)
        [failed] = _events(b, SEED_FAILED)
        worker = _worker_in(b_node, b)
        refused = _events(a, "seed data connection refused")
        mapped = mooncake_mapped(a.pid)

    assert (model.state, model.source) == (pb.MODEL_STATE_READY, "checkpoint")
    assert (failed["result"], failed["why"]) == (
        "transfer",
        f"from {link.a_ip}:{PORT}: {NOT_OFFERED_WHY}",
    )
    assert NOT_OFFERED_WHY == "the peer does not offer the mooncake data plane (--seed-mooncake)"
    assert refused and {r["why"] for r in refused} == {NOT_OFFERED_WHY}
    assert mapped is False  # a daemon without --seed-mooncake never imports Mooncake
    assert _events(b, "seeded") == []
    assert worker == {"source": "cache", "tensors": 9}
