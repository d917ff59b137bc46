"""Hugging Face Hub repo ids as model arguments, one rule for the daemon (start-up models,
the Preload RPC), ``weightcache load``, the SDK (``weightcache.load("org/name")``) and the
vLLM loader: ``org/name`` (or ``org/name@REVISION``) names a snapshot already in the local
Hub cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``),
found through ``huggingface_hub``'s own cache API (``snapshot_download`` with
``local_files_only``), never by walking its layout here, and never downloaded.

A model loaded from a repo id is named after it (:attr:`HubModel.name`): ``org/name``, or
``org/name@REVISION`` when a revision was asked for, not after the snapshot's 40-hex
commit folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from weightcache.core.errors import InvalidCheckpointError


@dataclass(frozen=True)
class HubModel:
    """A repo id resolved in the local Hub cache.

    Attributes:
        path: the snapshot folder (its files are symlinks into the repo's ``blobs/``).
        repo_id: ``org/name``.
        revision: the branch, tag or commit asked for; None when none was (``main``).
        commit: the snapshot's commit (its folder's name).
    """

    path: str
    repo_id: str
    revision: str | None
    commit: str

    @property
    def name(self) -> str:
        """The model's name: ``org/name``, or ``org/name@REVISION`` when a revision was
        asked for."""
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def split_revision(text: str) -> tuple[str, str | None]:
    """``org/name@rev`` → (``org/name``, ``rev``); without ``@``, the revision is None."""
    repo_id, sep, revision = text.partition("@")
    return repo_id, (revision or None) if sep else None


def find(text: str, revision: str | None = None) -> HubModel | None:
    """The cached snapshot ``text`` names, or None when ``text`` is an existing path.

    Args:
        text: a path, or a repo id ``org/name`` (``org/name@rev`` names a revision too).
        revision: the branch, tag or commit; wins over one in ``text``; default ``main``.

    Raises:
        InvalidCheckpointError: ``text`` is neither an existing path nor a repo id whose
            revision is in the local Hub cache (the message says which was tried).
    """
    if os.path.exists(text):
        return None
    repo_id, named = split_revision(text)
    revision = revision or named
    # Imported here: the admin commands that never see a repo id start without it.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path: str = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except HFValidationError:
        raise InvalidCheckpointError(f"{text}: no such file or folder") from None
    except LocalEntryNotFoundError:
        raise InvalidCheckpointError(
            f"{text}: no such file or folder, nor a Hub repo with revision "
            f"{revision or 'main'} in the local Hub cache (download it first, e.g. "
            "`hf download`)"
        ) from None
    return HubModel(path, repo_id, revision, os.path.basename(path))


def resolve_model(text: str, revision: str | None = None) -> str:
    """A model argument as a local path: ``text`` itself when it exists on disk, else the
    folder of the cached snapshot of the Hub repo ``text`` names (:func:`find`).

    Raises:
        InvalidCheckpointError: ``text`` is neither an existing path nor a cached repo.
    """
    found = find(text, revision)
    return text if found is None else found.path


def resolve_or_keep(text: str) -> tuple[str, str | None, str | None]:
    """:func:`find`, but a ``text`` that names nothing is kept as given, with the reason:
    the daemon then refuses it like any missing path (and serves the others).

    Returns:
        The path to preload, the model's name (None: the folder's basename, as for any
        path), and why ``text`` was not resolved (None when it was).
    """
    try:
        found = find(text)
    except InvalidCheckpointError as err:
        return text, None, err.detail
    if found is None:
        return text, None, None
    return found.path, found.name, None
