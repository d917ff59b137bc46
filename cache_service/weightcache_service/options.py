"""What the operator allowed the daemon: :class:`ServiceOptions`, given to the cache
(:mod:`.cache`) and read by its parts, which do not import the cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from weightcache_service.dataplane import DEFAULT_STALL_TIMEOUT

#: ``(cert, key, ca)``: PEM paths of the mutual-TLS identity used towards peers.
PeerTlsFiles = tuple[str, str, str]


@dataclass
class ServiceOptions:
    """What the operator allowed.

    Attributes:
        allow_remote_preload: accept Preload RPCs at all.
        model_roots: folders (realpath) a remote Preload path must resolve inside.
        drain_timeout: seconds lease holders get after REVOKING (a forced Evict, or a
            drain at SIGTERM) before the memory is freed.
        allowed_plugins: recipe plugins a remote Preload may name.
        peer_tls: ``(cert, key, ca)`` PEM paths for seeding from peers (mutual TLS).
    """

    allow_remote_preload: bool = False
    model_roots: list[Path] = field(default_factory=list)
    drain_timeout: float = 30.0
    allowed_plugins: frozenset[str] = frozenset()
    #: ``--peer-tls-cert/--peer-tls-key/--peer-tls-ca``: what a seed presents to a peer.
    peer_tls: PeerTlsFiles | None = None
    #: Parallel data-plane streams and bytes per chunk of a seed (:mod:`.dataplane`).
    seed_streams: int = 4
    seed_chunk_bytes: int = 4 << 20
    #: ``--seed-stall-timeout``: seconds within which each seed stream must receive a
    #: chunk, or the seed is abandoned for the files.
    seed_stall_timeout: float = DEFAULT_STALL_TIMEOUT
    #: ``--seed-plane``: ``tcp`` asks a peer for its sendfile data plane; ``grpc`` does not;
    #: ``mooncake`` asks for its Mooncake plane (:mod:`.mooncake_plane`) only.
    seed_plane: str = "tcp"
