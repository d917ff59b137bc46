"""The hand-over manifest: what a daemon stopping for a restart leaves to its successor.

A daemon told to hand over (SIGUSR2, or SIGTERM with ``--hand-over``) leaves its READY
shared-memory arenas in ``/dev/shm`` and writes ``<socket>.handover.json`` beside its
socket: for each model its segment, size, checkpoint path and files (identities), recipe,
placement, fingerprint and live leases (each with its create time and its worker's
description). The next daemon on the same socket reads it once
(and removes it), and adopts each model that checks out (:func:`read_manifest`,
:func:`check_segment`; the store rebuilds the layout from the checkpoint's headers and
compares it), without reading the tensors again; what does not check out is removed with
the other segments of dead daemons, and the model is loaded from its checkpoint as usual.

Trust: the manifest is accepted only as a regular file (not a symlink) owned by the
daemon's own user with mode 0600, of the format :data:`FORMAT`, under
:data:`MAX_MANIFEST_BYTES`; each segment only as a regular file directly in ``/dev/shm``,
owned by the daemon's user, named for this socket (:func:`~weightcache.core.sockets.tag_prefix`),
of exactly the size recorded. See SECURITY.md, "Hand-over".

The format is JSON; recipe, placement and fingerprint are their protobuf messages in
protobuf's JSON mapping (``google.protobuf.json_format``), so that one definition of each
serves the wire and the manifest.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from weightcache.core.checkpoint import FileIdentity
from weightcache.core.errors import WeightCacheError
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.protocol import (
    MAX_PATH_CHARS,
    fingerprint_from_pb,
    fingerprint_pb,
    placement_from_pb,
    placement_pb,
    recipe_from_pb,
    recipe_pb,
)
from weightcache.core.recipe import Placement, Recipe
from weightcache.core.records import WorkerDescription
from weightcache.core.sockets import SHM_DIR, tag_prefix
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache_service.leases import MAX_LEASES

#: The manifest format this daemon writes and reads; any other is refused whole.
FORMAT = "weightcache.handover/1"
#: A manifest larger than this is refused unread (a few hundred bytes per model).
MAX_MANIFEST_BYTES = 16 * 2**20


class HandOverRefusedError(Exception):
    """A manifest or a segment does not check out; the message says why."""


@dataclass(frozen=True)
class HeldLease:
    """A live lease handed over: its id, TTL (s), request id and the worker's pid; when
    it was granted (``create_time``, epoch seconds; None in a manifest written before
    the field) and the worker's description of itself, so that ListLeases shows the
    same after the hand-over as before (issue 37, item 15)."""

    lease_id: str
    ttl: float
    request_id: str
    pid: int
    create_time: float | None = None
    worker: WorkerDescription | None = None


@dataclass(frozen=True)
class HeldModel:
    """One model handed over.

    Attributes:
        name: its name in the old daemon.
        path: the checkpoint's folder (or file) as the old daemon opened it.
        segment: the segment's path in ``/dev/shm``.
        size: the arena's size in bytes.
        files: every file the old daemon read, by name, with its identity then.
        recipe, placement: what the model was loaded with (the recipe as asked for).
        fingerprint: the model's fingerprint.
        load_seconds, create_time: as the old daemon reported them.
        leases: its live leases.
        source: where its bytes came from (``checkpoint``, ``peer HOST:PORT``).
        files_confirmed: whether its bytes are known to be its files' (False for a model
            seeded from a peer without the local hash cache's confirmation: then no
            Acquire by file identity matches it, in the successor either).
    """

    name: str
    path: str
    segment: str
    size: int
    files: dict[str, FileIdentity]
    recipe: Recipe
    placement: Placement
    fingerprint: Fingerprint
    load_seconds: float
    create_time: float
    leases: tuple[HeldLease, ...]
    source: str = "checkpoint"
    files_confirmed: bool = True


def manifest_path(socket: str) -> str:
    """Where the daemon of ``socket`` writes its hand-over manifest."""
    return socket + ".handover.json"


def write_manifest(path: str, instance_id: str, models: list[HeldModel]) -> None:
    """Write the manifest atomically (a temporary file in the same folder, fsync'd, renamed
    over ``path``), mode 0600.

    Raises:
        OSError: it cannot be written.
    """
    document = {
        "format": FORMAT,
        "instance_id": instance_id,
        "pid": os.getpid(),
        "models": [_model_json(model) for model in models],
    }
    data = json.dumps(document, indent=1, sort_keys=True).encode()
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.rename(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def read_manifest(path: str, refused: list[str]) -> list[HeldModel] | None:
    """Read and remove the manifest at ``path`` (None when there is none).

    Each model entry is checked field by field (:func:`_model_from_json`); an entry that
    does not check out is left out, and why is appended to ``refused`` (its segment is
    then removed with the predecessor's others).

    Raises:
        HandOverRefusedError: it is a symlink or not a regular file, not owned by this user,
            not mode 0600, over :data:`MAX_MANIFEST_BYTES`, not valid JSON, of another
            format, or holds no list of models. It is removed all the same.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise HandOverRefusedError(f"cannot open the manifest {path}: {exc.strerror}") from None
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # read once: a failed adoption is not retried at the next start
        st = os.fstat(fd)
        _check_file(st, path)
        data = os.read(fd, MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_MANIFEST_BYTES:
        raise HandOverRefusedError(f"the manifest is over {MAX_MANIFEST_BYTES} bytes")
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise HandOverRefusedError(f"the manifest is not valid JSON: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else None
        raise HandOverRefusedError(
            f"the manifest's format is {found!r}; this daemon reads {FORMAT!r}"
        )
    items = document.get("models")
    if not isinstance(items, list):
        raise HandOverRefusedError("the manifest is malformed: no list of models")
    # Only with a manifest to read: a start without one does not import it (issue 39).
    from google.protobuf import json_format

    held = []
    for index, item in enumerate(items):
        try:
            if not isinstance(item, dict):
                raise HandOverRefusedError("not an object")
            held.append(_model_from_json(item))
        except HandOverRefusedError as exc:
            refused.append(f"model {index}: {exc}")
        except (KeyError, TypeError, ValueError, json_format.ParseError, WeightCacheError) as exc:
            refused.append(f"model {index}: malformed: {type(exc).__name__}: {exc}")
    return held


def check_segment(model: HeldModel, tag: str) -> None:
    """Check a handed-over segment before it is opened: named for this socket, directly in
    ``/dev/shm``, a regular file owned by this user, of the recorded size.

    Raises:
        HandOverRefusedError: it is not.
    """
    folder, name = os.path.split(model.segment)
    if folder != SHM_DIR or not name.startswith(tag_prefix(tag)):
        raise HandOverRefusedError(f"{model.segment} is not a segment of this socket")
    try:
        st = os.stat(model.segment, follow_symlinks=False)
    except FileNotFoundError:
        raise HandOverRefusedError(f"{model.segment} is gone") from None
    if not stat.S_ISREG(st.st_mode):
        raise HandOverRefusedError(f"{model.segment} is not a regular file")
    if st.st_uid != os.geteuid():
        raise HandOverRefusedError(
            f"{model.segment} belongs to uid {st.st_uid}, not {os.geteuid()}"
        )
    if st.st_size != model.size:
        raise HandOverRefusedError(
            f"{model.segment} holds {st.st_size} bytes; the manifest says {model.size}"
        )


def _check_file(st: os.stat_result, path: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise HandOverRefusedError(f"the manifest {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise HandOverRefusedError(
            f"the manifest {path} belongs to uid {st.st_uid}, not {os.geteuid()}"
        )
    if stat.S_IMODE(st.st_mode) != 0o600:
        raise HandOverRefusedError(
            f"the manifest {path} has mode {stat.S_IMODE(st.st_mode):04o}, not 0600"
        )


def _model_json(model: HeldModel) -> dict[str, Any]:
    from google.protobuf import json_format

    return {
        "name": model.name,
        "path": model.path,
        "segment": model.segment,
        "size": model.size,
        "files": {name: asdict(identity) for name, identity in model.files.items()},
        "recipe": json_format.MessageToDict(recipe_pb(model.recipe)),
        "placement": json_format.MessageToDict(placement_pb(model.placement)),
        "fingerprint": json_format.MessageToDict(fingerprint_pb(model.fingerprint)),
        "load_seconds": model.load_seconds,
        "create_time": model.create_time,
        "leases": [_lease_json(lease) for lease in model.leases],
        "source": model.source,
        "files_confirmed": model.files_confirmed,
    }


#: Bounds a manifest entry's numbers must meet (issue 37, item 11: a NaN TTL made an
#: immortal lease and ListLeases INTERNAL; a create_time of 1e300 made ListModels and
#: Evict INTERNAL for everyone).
MAX_ARENA_BYTES = 2**50
MAX_LOAD_SECONDS = 10**7
MAX_LEASE_TTL = 86_400.0
MAX_PID = 2**22  # Linux's largest pid_max
#: Seconds a create_time may lie ahead of this daemon's clock.
CLOCK_SLACK = 86_400.0


def _integer(value: object, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HandOverRefusedError(f"{field} {value!r} is not an integer in [{low}, {high}]")
    return value


def _number(value: object, field: str, low: float, high: float) -> float:
    number = (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    )
    if number is None or not math.isfinite(number) or not low <= number <= high:
        raise HandOverRefusedError(f"{field} {value!r} is not a number in [{low}, {high}]")
    return number


def _string(value: object, field: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_PATH_CHARS:
        raise HandOverRefusedError(
            f"{field} is not a string of at most {MAX_PATH_CHARS} characters"
        )
    return value


def _identity(value: object, field: str) -> FileIdentity:
    if not isinstance(value, dict) or set(value) != {f.name for f in fields(FileIdentity)}:
        raise HandOverRefusedError(f"{field} is not a file identity")
    return FileIdentity(**{k: _integer(v, f"{field}.{k}", 0, 2**64) for k, v in value.items()})


def _lease_json(lease: HeldLease) -> dict[str, Any]:
    return {k: v for k, v in asdict(lease).items() if v is not None}


def _worker(value: object, field: str) -> WorkerDescription:
    if not isinstance(value, dict) or set(value) != {f.name for f in fields(WorkerDescription)}:
        raise HandOverRefusedError(f"{field} is not a worker description")
    return WorkerDescription(
        pid=_integer(value["pid"], f"{field}.pid", 0, MAX_PID),
        hostname=_string(value["hostname"], f"{field}.hostname"),
        label=_string(value["label"], f"{field}.label"),
        pid_namespace=_integer(value["pid_namespace"], f"{field}.pid_namespace", 0, 2**64),
        mode=_string(value["mode"], f"{field}.mode"),
    )


def _lease(value: object, field: str) -> HeldLease:
    if not isinstance(value, dict):
        raise HandOverRefusedError(f"{field} is not a lease")
    created, worker = value.get("create_time"), value.get("worker")
    return HeldLease(
        _string(value["lease_id"], f"{field}.lease_id"),
        _number(value["ttl"], f"{field}.ttl", 0.0, MAX_LEASE_TTL),
        _string(value["request_id"], f"{field}.request_id"),
        _integer(value["pid"], f"{field}.pid", 0, MAX_PID),
        # Both absent from a manifest written before issue 37, item 15.
        None
        if created is None
        else _number(created, f"{field}.create_time", 0.0, time.time() + CLOCK_SLACK),
        None if worker is None else _worker(worker, f"{field}.worker"),
    )


def _model_from_json(item: dict[str, Any]) -> HeldModel:
    """One manifest entry, checked field by field (types, finite numbers in range).

    Raises:
        HandOverRefusedError: a field is out of range or of the wrong type.
        KeyError, TypeError, ValueError, json_format.ParseError, WeightCacheError: a
            field is missing, or a message does not parse.
    """
    from google.protobuf import json_format

    recipe = json_format.ParseDict(item["recipe"], pb.Recipe())
    placement = json_format.ParseDict(item["placement"], pb.Placement())
    fingerprint = json_format.ParseDict(item["fingerprint"], pb.Fingerprint())
    files, leases = item["files"], item["leases"]
    if not isinstance(files, dict) or not isinstance(leases, list) or len(leases) > MAX_LEASES:
        raise HandOverRefusedError(f"files or leases malformed (at most {MAX_LEASES} leases)")
    return HeldModel(
        name=_string(item["name"], "name"),
        path=_string(item["path"], "path"),
        segment=_string(item["segment"], "segment"),
        size=_integer(item["size"], "size", 1, MAX_ARENA_BYTES),
        files={_string(k, "files"): _identity(v, f"files[{k!r}]") for k, v in files.items()},
        recipe=recipe_from_pb(recipe),
        placement=placement_from_pb(placement),
        fingerprint=fingerprint_from_pb(fingerprint),
        load_seconds=_number(item["load_seconds"], "load_seconds", 0.0, MAX_LOAD_SECONDS),
        create_time=_number(item["create_time"], "create_time", 0.0, time.time() + CLOCK_SLACK),
        leases=tuple(_lease(x, f"leases[{i}]") for i, x in enumerate(leases)),
        source=_string(item.get("source", "checkpoint"), "source"),
        files_confirmed=item.get("files_confirmed", True) is True,
    )
