"""Admission of remote Preloads: what the operator allows a Preload RPC to name
(SECURITY.md): remote Preload at all (``--allow-remote-preload``), paths and Hub snapshots
inside a ``--model-root``, recipe plugins among ``--allow-recipe``, and every file opened
inside a root (:meth:`Admission.check_opened`). The servicer asks before a load begins;
:mod:`.loading` checks each file as it opens it."""

from __future__ import annotations

import os
from pathlib import Path

from weightcache.core import hub
from weightcache.core.errors import (
    InvalidArgumentError,
    InvalidCheckpointError,
    PermissionDeniedError,
)
from weightcache.core.protocol import MAX_ID_CHARS, MAX_PATH_CHARS, check_len
from weightcache_service.options import ServiceOptions
from weightcache_service.store import clip


class Admission:
    """The operator's rules for remote Preloads.

    Args:
        options: what the operator allowed (``allow_remote_preload``, ``model_roots``,
            ``allowed_plugins``).
    """

    def __init__(self, options: ServiceOptions) -> None:
        self._options = options

    def remote_path(self, path: str) -> str:
        """The realpath of a remote Preload's ``path``, if the operator allows it: an early
        refusal; each file is checked again as opened (:meth:`check_opened`).

        Raises:
            PermissionDeniedError: remote Preload is disabled, or the path resolves outside
                every ``--model-root``.
            InvalidArgumentError: the path is over :data:`MAX_PATH_CHARS` characters, empty,
                or holds NUL (``field=path``).
        """
        self._check_remote_preload()
        check_len("path", path, MAX_PATH_CHARS)
        if not path or "\0" in path:
            raise InvalidArgumentError("path is empty or holds NUL", metadata={"field": "path"})
        real = Path(os.path.realpath(path))
        for root in self._options.model_roots:
            if real == root or root in real.parents:
                return str(real)
        raise PermissionDeniedError(
            f"{clip(path)} resolves to {clip(str(real))}, outside every --model-root",
            metadata={"path": clip(str(real))},
        )

    def _check_remote_preload(self) -> None:
        if not self._options.allow_remote_preload:
            raise PermissionDeniedError(
                "remote Preload is disabled; start the daemon with --allow-remote-preload "
                "and --model-root"
            )

    def remote_hub_model(self, repo_id: str, revision: str) -> tuple[str, str]:
        """The realpath and model name of a remote Preload's Hub repo id: its snapshot in
        this daemon's local Hub cache (:func:`weightcache.core.hub.find`, never
        downloaded), which must lie inside a ``--model-root`` (:meth:`remote_path`).

        Raises:
            PermissionDeniedError: remote Preload is disabled, or the snapshot resolves
                outside every ``--model-root``.
            InvalidArgumentError: ``repo_id`` or ``revision`` is over
                :data:`MAX_PATH_CHARS` characters, or ``repo_id`` holds ``@`` or NUL.
            InvalidCheckpointError: no such repo or revision in the local Hub cache.
        """
        self._check_remote_preload()  # before the Hub cache is looked at
        for field_name, value in (("repo_id", repo_id), ("revision", revision)):
            check_len(field_name, value, MAX_PATH_CHARS)
        if "@" in repo_id or "\0" in repo_id + revision:
            raise InvalidArgumentError(
                "repo_id holds '@' or NUL (the revision goes in the revision field)",
                metadata={"field": "repo_id"},
            )
        found = hub.find(repo_id, revision or None) if not os.path.isabs(repo_id) else None
        if found is None:
            raise InvalidCheckpointError(f"{clip(repo_id)}: not a Hub repo id (org/name)")
        return self.remote_path(found.path), found.name

    def admit_plugin(self, name: str) -> None:
        """Refuse a recipe plugin the operator did not allow for remote Preload.

        Raises:
            PermissionDeniedError: ``name`` is not among ``--allow-recipe``.
        """
        if name not in self._options.allowed_plugins:
            raise PermissionDeniedError(
                f"recipe plugin {name!r} is not allowed; the operator allows "
                f"{sorted(self._options.allowed_plugins)} (--allow-recipe)",
                metadata={"plugin": name[:MAX_ID_CHARS]},
            )

    def check_opened(self, real: Path) -> None:
        """Refuse an opened checkpoint file whose real location is outside every model root.

        Raises:
            PermissionDeniedError: ``real`` is outside every ``--model-root``.
        """
        if not any(real == root or root in real.parents for root in self._options.model_roots):
            raise PermissionDeniedError(
                f"{clip(str(real))} is outside every --model-root",
                metadata={"path": clip(str(real))},
            )
