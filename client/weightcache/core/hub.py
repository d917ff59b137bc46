"""Hugging Face Hub repo ids as model arguments, one rule for the daemon (start-up models,
the Preload RPC), ``weightcache load``, the SDK (``weightcache.load("org/name")``) and the
vLLM loader: ``org/name`` (or ``org/name@REVISION``) names a snapshot already in the local
Hub cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``),
found through ``huggingface_hub``'s own cache API (``snapshot_download`` with
``local_files_only``), never by walking its layout here, and never downloaded.

A model loaded from a repo id is named after it (:attr:`HubModel.name`): ``org/name``, or
``org/name@REVISION`` when a revision was asked for, not after the snapshot's 40-hex
commit folder.

A revision is checked before any file is opened (:func:`check_revision`: a commit hash,
or a ref name by git's ``check-ref-format`` rules, so ``..`` and the like never reach a
path), and a branch or tag is resolved to its commit here (:func:`_ref_commit`): the
``refs/`` file is opened without following a symlink or blocking on a FIFO, must be a
regular file of at most :data:`MAX_REF_BYTES` bytes, and must hold a commit hash.
``huggingface_hub`` reads that file whole, through symlinks (issue 37, item 2), so it is
only ever given the commit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from weightcache.core.errors import InvalidArgumentError, InvalidCheckpointError
from weightcache.core.sidefiles import open_regular

#: A full commit hash (``huggingface_hub``'s ``REGEX_COMMIT_HASH``).
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")

#: Largest ``refs/`` file read: one commit hash and a newline.
MAX_REF_BYTES = 64

# git check-ref-format(1), rules 3-10: "..", control characters, space, ~ ^ : ? * [ \,
# "@{", a leading or trailing "/", "//", a trailing ".".
_BAD_REF = re.compile(r"\.\.|[\x00-\x20\x7f~^:?*\[\\]|@\{|^/|/$|//|\.$")


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


def check_revision(revision: str) -> None:
    """Refuse a revision that is neither a commit hash nor a ref name git would accept.

    Rules from git's ``check-ref-format`` (one-level names allowed, as ``main``): no
    component starts with ``.`` or ends with ``.lock``; no ``..``, ``@{``, ``//``, control
    character, space, ``~ ^ : ? * [ \\``; not ``@``; no leading or trailing ``/``, no
    trailing ``.``.

    Raises:
        InvalidArgumentError: the revision breaks one of those rules (``field=revision``).
    """
    if COMMIT_HASH.fullmatch(revision):
        return
    parts = revision.split("/")
    if (
        not revision
        or revision == "@"
        or _BAD_REF.search(revision)
        or any(part.startswith(".") or part.endswith(".lock") for part in parts)
    ):
        raise InvalidArgumentError(
            f"revision {revision[:200]!r} is neither a commit hash nor a valid ref name "
            "(git check-ref-format)",
            metadata={"field": "revision"},
        )


def read_ref(repo_folder: str | os.PathLike[str], revision: str) -> str | None:
    """The commit a branch or tag names in a Hub cache repo folder (``models--ORG--NAME``),
    or None when it has no such ref. The ``refs/`` file is opened with ``O_NOFOLLOW |
    O_NONBLOCK`` (a symlink or a FIFO planted there neither redirects nor blocks the read)
    and read only when regular and at most :data:`MAX_REF_BYTES` bytes. Check the
    revision first (:func:`check_revision`).

    Raises:
        InvalidCheckpointError: the ref file is not a regular file, is too large, or does
            not hold a commit hash.
    """
    path = os.path.join(repo_folder, "refs", revision)
    fd = open_regular(path, MAX_REF_BYTES, follow=False)
    if fd is None:
        return None
    try:
        text = os.read(fd, MAX_REF_BYTES + 1).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if not COMMIT_HASH.fullmatch(text):
        raise InvalidCheckpointError(f"{path}: does not hold a commit hash")
    return text


def _ref_commit(repo_id: str, revision: str) -> str | None:
    """:func:`read_ref` in the local Hub cache (``huggingface_hub``'s own constant and
    folder naming)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    return read_ref(os.path.join(constants.HF_HUB_CACHE, folder), revision)


def find(text: str, revision: str | None = None) -> HubModel | None:
    """The cached snapshot ``text`` names, or None when ``text`` is an existing path.

    Args:
        text: a path, or a repo id ``org/name`` (``org/name@rev`` names a revision too).
        revision: the branch, tag or commit; wins over one in ``text``; default ``main``.

    Raises:
        InvalidCheckpointError: ``text`` is neither an existing path nor a repo id whose
            revision is in the local Hub cache (the message says which was tried), or
            the revision's ``refs/`` file is not a small regular file holding a commit.
        InvalidArgumentError: the revision is malformed (:func:`check_revision`).
    """
    if os.path.exists(text):
        return None
    repo_id, named = split_revision(text)
    revision = revision or named
    # Imported here: the admin commands that never see a repo id start without it.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    # Public (its documentation's "Validators"), exported lazily, which mypy cannot see.
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]

    absent = InvalidCheckpointError(
        f"{text}: no such file or folder, nor a Hub repo with revision "
        f"{revision or 'main'} in the local Hub cache (download it first, e.g. "
        "`hf download`)"
    )
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise InvalidCheckpointError(f"{text}: no such file or folder") from None
    wanted = revision or "main"
    check_revision(wanted)
    commit = wanted if COMMIT_HASH.fullmatch(wanted) else _ref_commit(repo_id, wanted)
    if commit is None:
        raise absent
    try:
        # Given the commit only: huggingface_hub would read refs/<revision> unbounded.
        path: str = snapshot_download(repo_id, revision=commit, local_files_only=True)
    except HFValidationError:
        raise InvalidCheckpointError(f"{text}: no such file or folder") from None
    except LocalEntryNotFoundError:
        raise absent from None
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
    except (InvalidCheckpointError, InvalidArgumentError) as err:
        return text, None, err.detail
    if found is None:
        return text, None, None
    return found.path, found.name, None
