"""Where vLLM keeps its own caches when it starts through ``weightcache-vllm``: in a
folder beside the daemon's arenas, which outlives the server's container, so that a
restarted server finds them (issue 38, Build 4).

vLLM writes two caches under ``VLLM_CACHE_ROOT`` (default ``~/.cache/vllm``,
``vllm/envs.py``) while it starts:

- ``modelinfos/``: what its model registry learnt of a model class. Where an entry is
  missing, vLLM learns it in a child interpreter that imports vLLM
  (``vllm/model_executor/models/registry.py``, ``_run_in_subprocess``): about 7 s of the
  API server's start on 2 CPUs (``bench/README.md``, issue 38).
- ``torch_compile_cache/``: torch.compile's artefacts for the model (Dynamo's traced
  graphs, AOT-compiled functions, compiled kernels), each under vLLM's own hash of
  everything that decides them (the configuration, the model's source, the compiler's
  versions: ``vllm/compilation/backends.py``, ``decorators.py``): the rest of a
  compiling start's warm-up (17 s of a first compile against 4 s with the cache, same
  bench).

In a container, ``~/.cache`` is the container's own layer and starts empty after every
restart: every restart pays both. The daemon's arenas live in ``/dev/shm``, which every
weightcache deployment shares between the daemon and its engines and which outlives an
engine's container (deploy/README.md); ``weightcache-vllm`` points ``VLLM_CACHE_ROOT``
there, at ``/dev/shm/weightcache-vllm-cache-UID``, unless the user chose otherwise. vLLM's
own hashes decide what in it may be used, as they do in ``~/.cache/vllm``.

Choosing (``WEIGHTCACHE_VLLM_CACHE``, read by :func:`keep_caches`):

- ``VLLM_CACHE_ROOT`` already set: untouched (the user chose);
- ``WEIGHTCACHE_VLLM_CACHE=off``: vLLM's default;
- ``WEIGHTCACHE_VLLM_CACHE=DIR``: ``DIR``;
- unset: ``/dev/shm/weightcache-vllm-cache-UID``.

The artefacts are code the engine runs (pickled graphs, compiled libraries), so the folder
is its user's alone, as ``~/.cache`` is: it is created with mode 0700, and an existing one
is used only when it is a directory (not a symbolic link) owned by this process's
effective user with no access for group or others; otherwise vLLM's default is kept and
a warning on standard error says why. The name never matches a daemon's segment
(``weightcache_service.segments``): no daemon or ``weightcache gc`` removes it.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import MutableMapping

#: The variable vLLM reads its cache folder from (``vllm/envs.py``).
VLLM_CACHE_ROOT = "VLLM_CACHE_ROOT"
#: The variable that chooses the folder: a path, or :data:`OFF`.
WEIGHTCACHE_VLLM_CACHE = "WEIGHTCACHE_VLLM_CACHE"
#: The value of :data:`WEIGHTCACHE_VLLM_CACHE` that leaves vLLM's default.
OFF = "off"
#: The folder's name in ``/dev/shm`` for effective user ``UID``.
DEFAULT_TEMPLATE = "/dev/shm/weightcache-vllm-cache-{uid}"


def chosen_folder(environ: MutableMapping[str, str]) -> str | None:
    """The folder :func:`keep_caches` would use for ``environ``, before any check; None
    where vLLM's own choice stands (``VLLM_CACHE_ROOT`` set, or
    ``WEIGHTCACHE_VLLM_CACHE=off``)."""
    if environ.get(VLLM_CACHE_ROOT):
        return None
    chosen = environ.get(WEIGHTCACHE_VLLM_CACHE, "")
    if chosen == OFF:
        return None
    return chosen or DEFAULT_TEMPLATE.format(uid=os.geteuid())


def private_folder(path: str) -> str | None:
    """Make ``path`` (mode 0700) unless it exists; why it may not hold vLLM's caches, or
    None when it may: a directory, not a symbolic link, owned by this process's effective
    user, with no access for group or others.

    Raises nothing: every ``OSError`` becomes the reason.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror}"
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"cannot stat {path}: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != os.geteuid():
        return f"{path} is owned by uid {info.st_uid}, not by this user ({os.geteuid()})"
    if info.st_mode & 0o077:
        return f"{path} is open to group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def keep_caches(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Point ``VLLM_CACHE_ROOT`` in ``environ`` (default ``os.environ``, which vLLM's
    processes inherit) at the chosen folder (module docstring); the folder, or None where
    vLLM's own choice stands. A folder refused by :func:`private_folder` is named on
    standard error with the reason, and vLLM's default stands.

    Raises nothing.
    """
    environ = os.environ if environ is None else environ
    folder = chosen_folder(environ)
    if folder is None:
        return None
    refused = private_folder(folder)
    if refused is not None:
        print(
            f"weightcache-vllm: vLLM's caches stay in its default folder: {refused}",
            file=sys.stderr,
        )
        return None
    environ[VLLM_CACHE_ROOT] = folder
    return folder
