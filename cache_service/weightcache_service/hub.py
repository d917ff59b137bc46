"""Hugging Face Hub repo ids as model arguments: ``org/name`` (or ``org/name@REVISION``)
names a snapshot already in the local Hub cache (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), found through ``huggingface_hub``'s
own cache API, never by walking its layout here, and never downloaded: the daemon serves
what is on disk.
"""

from __future__ import annotations

import os

from weightcache.core.errors import InvalidCheckpointError


def split_revision(text: str) -> tuple[str, str | None]:
    """``org/name@rev`` → (``org/name``, ``rev``); without ``@``, the revision is None."""
    repo_id, sep, revision = text.partition("@")
    return repo_id, (revision or None) if sep else None


def resolve_model(text: str, revision: str | None = None) -> str:
    """A model argument as a local path: ``text`` itself when it exists on disk, else the
    folder of the cached snapshot of the Hub repo ``text`` names (branch, tag or commit
    ``revision``; ``org/name@rev`` also names one; default ``main``).

    Raises:
        InvalidCheckpointError: ``text`` is neither an existing path nor a repo id whose
            revision is in the local Hub cache (the message says which was tried).
    """
    if os.path.exists(text):
        return text
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
    return path


def resolve_or_keep(text: str) -> tuple[str, str | None]:
    """:func:`resolve_model`, but a ``text`` that names nothing is kept as given, with the
    reason: the daemon then refuses it like any missing path (and serves the others).

    Returns:
        The path to preload, and why ``text`` was not resolved (None when it was).
    """
    try:
        return resolve_model(text), None
    except InvalidCheckpointError as err:
        return text, err.detail
