"""``LoadOptions``: every option of :func:`weightcache.load`, as one typed, frozen value.

A worker builds its options once (from its config) and passes them to ``load(path,
options=...)`` or ``load_into(module, path, options=...)``; or it passes the same fields
as keywords (``load(path, device="cuda:0")``). Not both: keywords beside ``options`` raise
``TypeError``, so that no reader has to know which of the two would win. To change one
field of a shared value use ``dataclasses.replace(options, ttl=30.0)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal, TypedDict

from weightcache._lease import POLICIES, REVOKE_POLICIES, LostCallback, Policy, RevokePolicy
from weightcache.core.fingerprint import DEFAULT_LEVEL, LEVELS, Level
from weightcache.core.sockets import CPU, DeviceLike, parse_device

if TYPE_CHECKING:
    import torch

    from weightcache.core.recipe import Recipe

Mode = Literal["zero_copy", "copy"]
MODES: tuple[Mode, ...] = ("zero_copy", "copy")


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How :func:`weightcache.load` gets a checkpoint's weights. All fields are optional
    keywords; the defaults are those of ``load()`` called with no options.

    Attributes:
        socket: the daemon's Unix socket path. Default None: the socket of ``device``'s
            daemon by the rule of :mod:`weightcache.core.sockets` (``$WEIGHTCACHE_SOCKET``,
            else ``cpu.sock`` or ``GPU-<uuid>.sock`` in the runtime dir).
        device: whose daemon to use when ``socket`` is None: ``"cpu"`` (default),
            ``"cuda:N"``, ``"N"``, ``"cuda"``, a GPU UUID, an ``int`` N or a
            ``torch.device``. The GPU is found by its physical UUID, so this process's
            ``CUDA_VISIBLE_DEVICES`` numbering is the one to use. When the UUID cannot be
            read (torch sees no such device), ``load`` falls back to disk with the reason
            ``DEVICE_NOT_VISIBLE`` (or raises :class:`DeviceNotVisibleError` without
            ``fallback``). Not used to name the socket when ``socket`` is given (it is
            still checked: a text that names no device is a ``ValueError``). The
            tensors' device is the daemon's; a disk fallback returns CPU tensors.
        dtype: cast floating tensors (``"BF16"``, ``torch.float16``, ...); None (default)
            keeps the checkpoint's dtypes.
        recipe: the full recipe (dtype, tensor-parallel plan, plugins); None (default)
            means ``Recipe(dtype=dtype)``. Not together with ``dtype``.
        mode: ``"zero_copy"`` (default) maps the daemon's arena and holds a lease;
            ``"copy"`` copies into private memory and releases at once. On a disk
            fallback, ``"zero_copy"`` maps the shard files copy-on-write and ``"copy"``
            reads them into private memory (:func:`weightcache.load_from_disk`).
        fallback: True (default): load from disk, with the reason recorded, when the
            daemon cannot serve. False: wait up to ``wait_timeout`` for a daemon or a
            loading model, then raise.
        fingerprint_level: ``"full"`` (default), ``"sampled"`` or ``"layout"``. It must
            be the level the daemon fingerprinted the model at (its
            ``--fingerprint-level``): at another level the fingerprints differ and the
            worker falls back to disk, with ``FINGERPRINT_MISMATCH`` (the detail names the
            daemon's level) for a checkpoint the daemon holds.
        tp_rank, tp_size: tensor-parallel placement; default 0 of 1.
        ttl: lease TTL requested, in seconds, > 0; None (default): the daemon's default
            (``weightcache_service.leases.DEFAULT_TTL``, 10 s). The daemon clamps it; the
            lease keeps the TTL granted.
        wait_timeout: seconds, >= 0 (default 30.0), to wait for a model the daemon is
            still loading (and, without ``fallback``, for the daemon to come up): one
            wait for the whole load, from the first time it waits.
        lease_policy: ``"raise"``, ``"exit"`` or ``"ignore"`` when the lease is lost; None
            (default) picks the backend's: ``"ignore"`` for shared memory, ``"exit"`` for
            CUDA zero-copy. See :mod:`weightcache._lease`.
        on_lease_lost: called with the :class:`LeaseLostError` when the lease is lost;
            default None.
        on_revoke: ``"keep"`` (default), ``"copy"``, ``"raise"`` or ``"exit"``: what to do
            when the daemon revokes the lease (forced evict, drain). ``"keep"``: on shared
            memory keep the mapping, with no copy (the daemon has unlinked the segment; its
            bytes stay, unchanged, until ``close()``), and on a GPU copy, as ``"copy"``,
            which copies the arena into this process's own memory everywhere. See
            :mod:`weightcache._lease`.
        trusted_uid: a uid besides this user and root whose daemon socket is trusted;
            default None: ``$WEIGHTCACHE_TRUSTED_UID``. See :mod:`weightcache._trust`.

    Raises:
        ValueError: at construction: ``mode``, ``fingerprint_level``, ``lease_policy`` or
            ``on_revoke`` is not one of the documented values; ``device`` names no CPU or
            CUDA device (``"mps"``, ``"cuda:x"``, a negative index); both ``recipe`` and
            ``dtype`` are given; ``ttl`` is not > 0 or ``wait_timeout`` not >= 0 (or
            either is not finite).
        TypeError: a field is given positionally, or an unknown field is named.
    """

    socket: str | None = None
    device: DeviceLike = CPU
    dtype: str | torch.dtype | None = None
    recipe: Recipe | None = None
    mode: Mode = "zero_copy"
    fallback: bool = True
    fingerprint_level: Level = DEFAULT_LEVEL
    tp_rank: int = 0
    tp_size: int = 1
    ttl: float | None = None
    wait_timeout: float = 30.0
    lease_policy: Policy | None = None
    on_lease_lost: LostCallback | None = None
    on_revoke: RevokePolicy = "keep"
    trusted_uid: int | None = None

    def __post_init__(self) -> None:
        _one_of("mode", self.mode, MODES)
        _one_of("fingerprint_level", self.fingerprint_level, LEVELS)
        if self.lease_policy is not None:
            _one_of("lease_policy", self.lease_policy, POLICIES)
        _one_of("on_revoke", self.on_revoke, REVOKE_POLICIES)
        parse_device(self.device)  # its UUID is read only when a load needs the socket
        if self.recipe is not None and self.dtype is not None:
            raise ValueError("give dtype inside the recipe, not beside it")
        if self.ttl is not None and not (math.isfinite(self.ttl) and self.ttl > 0):
            raise ValueError(f"ttl must be a finite number of seconds > 0, not {self.ttl!r}")
        if not (math.isfinite(self.wait_timeout) and self.wait_timeout >= 0):
            raise ValueError(
                f"wait_timeout must be a finite number of seconds >= 0, not {self.wait_timeout!r}"
            )


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, not {value!r}")


class LoadKeywords(TypedDict, total=False):
    """The fields of :class:`LoadOptions` as keywords of ``load()`` and ``load_into()``
    (so that a type checker sees each one's type); tested equal to the dataclass's."""

    socket: str | None
    device: DeviceLike
    dtype: str | torch.dtype | None
    recipe: Recipe | None
    mode: Mode
    fallback: bool
    fingerprint_level: Level
    tp_rank: int
    tp_size: int
    ttl: float | None
    wait_timeout: float
    lease_policy: Policy | None
    on_lease_lost: LostCallback | None
    on_revoke: RevokePolicy
    trusted_uid: int | None


FIELDS = tuple(f.name for f in fields(LoadOptions))


def resolve(options: LoadOptions | None, keywords: LoadKeywords) -> LoadOptions:
    """``options``, or the options the keywords name.

    Raises:
        TypeError: both are given, ``options`` is not a :class:`LoadOptions`, or a
            keyword names no field.
        ValueError: as :class:`LoadOptions`.
    """
    if options is None:
        return LoadOptions(**keywords)
    if keywords:
        raise TypeError(
            f"give the options either as options= or as keywords, not both "
            f"(keywords given: {', '.join(sorted(keywords))})"
        )
    if not isinstance(options, LoadOptions):
        raise TypeError(f"options must be a LoadOptions, not {type(options).__name__}")
    return options
