"""What the cache reports as it happens: :class:`CacheEvents`, the sink :mod:`.metrics`
implements. A module of its own so that the parts of the cache that report (:mod:`.seeding`,
the cache itself) and the listener import it without importing each other (issue 39: the
``cache`` ↔ ``seeding`` import circle)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightcache_service.store import Entry


class CacheEvents:
    """What the cache reports as it happens (metrics listen, :mod:`.metrics`); this base
    ignores everything."""

    def acquired(self, reason: str, seconds: float, result: str = "") -> None:
        """An Acquire was answered in ``seconds``: ``reason`` empty when granted, else the
        refusal's reason (``MODEL_NOT_FOUND``...); ``result``, for a refusal the worker
        asks again after (not a fallback): ``probe_missed``, the miss of an Acquire by
        file identity, which the SDK follows with one by fingerprint; ``waiting``, a
        ``MODEL_LOADING`` the worker waits out (``asks_again_if_loading``)."""

    def loaded(self, entry: Entry) -> None:
        """A load ended (``entry.state`` says how)."""

    def preload_refused(self, reason: str) -> None:
        """A preload (start-up or Preload RPC) was refused before its load began: a
        malformed or missing checkpoint, a recipe that cannot apply, the memory budget
        (``reason``: the error's)."""

    def seeded(self, result: str, nbytes: int, seconds: float) -> None:
        """A seed from a peer ended: ``result`` is ``seeded``, or why the model is loaded
        from its files instead (:mod:`.seeding`); ``nbytes`` bytes made READY seeded (0
        otherwise) in ``seconds``."""

    def lease_expired(self) -> None:
        """A lease ended by its TTL."""

    def leases_revoked(self, count: int) -> None:
        """``count`` leases were revoked at once."""
