"""Helpers for the security and fuzz tests: other local users, a test PKI, this host's
addresses, TCP ports from daemon logs, and Acquire requests built like the client's.

Users and groups: :class:`TestUsers` creates ``wctest_group``, ``wctest_member`` (in the
group) and ``wctest_outsider`` (not in it) with ``groupadd``/``useradd`` when running as
root, and removes them when the last test session that uses them ends (sessions share them
through an ``flock`` on :data:`USERS_LOCK`: shared while in use, exclusive to create or
remove). Their code runs through ``runuser -u USER -- env -i ... python -c`` (see
:func:`run_as`), with the venv's site-packages added by path so that the interpreter
itself may live outside the venv when the venv's base interpreter is not readable by them.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import grp
import ipaddress
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import duration_pb2

import weightcache
from tests.support import Daemon
from weightcache.core.protocol import fingerprint_pb
from weightcache.v1 import weight_cache_service_pb2 as pb

GROUP = "wctest_group"
MEMBER = "wctest_member"
OUTSIDER = "wctest_outsider"
USERS_LOCK = "/tmp/wctest-users.lock"
#: The uid and gid of ``nobody`` (present on every Linux): "another user" that needs no setup.
NOBODY = 65534
#: Name the test server certificate carries (the channel overrides the target name to it).
TLS_NAME = "weightcache.test"
#: Common names of the test client certificates: one a daemon's allow-list names, one not.
CLIENT_NAME = "weightcache worker"
STRANGER_NAME = "weightcache stranger"
SYSTEM_PATHS = "/usr/sbin:/usr/bin:/sbin:/bin"


# -- other users ---------------------------------------------------------------------


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _in_group(user: str, group: str) -> bool:
    entry = pwd.getpwnam(user)
    gid = grp.getgrnam(group).gr_gid
    return entry.pw_gid == gid or user in grp.getgrnam(group).gr_mem


@dataclass(frozen=True)
class Users:
    """The test users and group, as created."""

    group: str
    gid: int
    member: str
    outsider: str
    outsider_uid: int


class TestUsers:
    """Creates the test users and group on :meth:`acquire`, removes them on :meth:`release`
    unless another session still holds them."""

    __test__ = False  # not a pytest test class

    def __init__(self) -> None:
        self._fd: int | None = None

    def acquire(self) -> Users | str:
        """The users, or the reason they cannot be had (a skip reason)."""
        if os.geteuid() != 0:
            return "not running as root: cannot create a second, unprivileged user"
        tools = {name: shutil.which(name, path=SYSTEM_PATHS) for name in _TOOLS}
        missing = sorted(name for name, path in tools.items() if path is None)
        if missing:
            return f"no {', '.join(missing)} on this machine"
        for _ in range(5):
            self._lock(fcntl.LOCK_EX)
            error = self._create()
            if error is not None:
                self.release()
                return error
            # Downgrading is not atomic: another session may have removed the users (and
            # the lock file) in between, so check both again under the shared lock.
            assert self._fd is not None
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            if (
                self._current()
                and all(_user_exists(u) for u in (MEMBER, OUTSIDER))
                and _group_exists(GROUP)
            ):
                return Users(
                    group=GROUP,
                    gid=grp.getgrnam(GROUP).gr_gid,
                    member=MEMBER,
                    outsider=OUTSIDER,
                    outsider_uid=pwd.getpwnam(OUTSIDER).pw_uid,
                )
            os.close(self._fd)
            self._fd = None
        return "the test users kept disappearing (another session removes them)"

    def _lock(self, mode: int) -> None:
        """Lock :data:`USERS_LOCK`, the file now at that path (the last user removes it)."""
        while True:
            fd = os.open(USERS_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, mode)
            self._fd = fd
            if self._current():
                return
            os.close(fd)
            self._fd = None

    def _current(self) -> bool:
        """Whether the locked file is still the one at :data:`USERS_LOCK`."""
        assert self._fd is not None
        try:
            return os.stat(USERS_LOCK, follow_symlinks=False).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return False

    @staticmethod
    def _create() -> str | None:
        shell = "/usr/sbin/nologin" if os.path.exists("/usr/sbin/nologin") else "/bin/false"
        steps: list[tuple[bool, list[str]]] = [
            (not _group_exists(GROUP), ["groupadd", "--system", GROUP]),
            (
                not _user_exists(MEMBER),
                ["useradd", "--system", "-M", "-N", "-g", GROUP, "-s", shell, MEMBER],
            ),
            (
                not _user_exists(OUTSIDER),
                ["useradd", "--system", "-M", "-N", "-s", shell, OUTSIDER],
            ),
        ]
        for needed, argv in steps:
            if not needed:
                continue
            done = _run(*argv)
            if done.returncode != 0:
                return f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}"
        if not _in_group(MEMBER, GROUP) or _in_group(OUTSIDER, GROUP):
            return f"{MEMBER} or {OUTSIDER} exists with the wrong membership of {GROUP}"
        return None

    def release(self) -> None:
        """Remove the users and the group if no other session holds them."""
        if self._fd is None:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # another session still uses them; the last one removes them
        else:
            for user in (MEMBER, OUTSIDER):
                if _user_exists(user):
                    _run("userdel", user)
            if _group_exists(GROUP):
                _run("groupdel", GROUP)
            if self._current():
                os.unlink(USERS_LOCK)  # waiters see a new file and start over
        finally:
            os.close(self._fd)
            self._fd = None


_TOOLS = ("useradd", "userdel", "groupadd", "groupdel", "runuser")

#: Runs as another user. argv[1] is a JSON job; prints one JSON line with the results.
USER_SCRIPT = r"""
import contextlib, io, json, os, socket, sys
job = json.loads(sys.argv[1])
import site
site.addsitedir(job["site"])
out = {"uid": os.getuid(), "groups": sorted(os.getgroups())}
try:
    import torch
    import weightcache
    from weightcache_service.cli import main as cli_main
except BaseException as exc:
    print(json.dumps({"import_error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)

if job.get("go"):
    import time
    deadline = time.monotonic() + job.get("go_timeout", 150)
    while not os.path.exists(job["go"]):
        if time.monotonic() > deadline:
            print(json.dumps({"go_timeout": job["go"]}))
            sys.exit(0)
        time.sleep(0.05)
    with open(job["go"]) as fh:
        job.update(json.load(fh))

def errno_name(exc):
    import errno
    return errno.errorcode.get(exc.errno, str(exc.errno))

try:
    if "checkpoint" not in job:
        raise LookupError("no checkpoint in the job")
    w = weightcache.load(job["checkpoint"], socket=job["socket"], mode="copy",
                         wait_timeout=5.0, fallback=True)
    reason = w.fallback_reason
    out["load"] = {
        "source": w.source,
        "reason": None if reason is None else reason.code,
        "detail": None if reason is None else reason.detail,
        "tensors": {
            name: [str(t.dtype), list(t.shape), t.contiguous().view(-1).view(torch.uint8)
                   .numpy().tobytes().hex()]
            for name, t in w.tensors.items()
        },
    }
except BaseException as exc:
    out["load"] = {"error": type(exc).__name__, "detail": str(exc)}
out["open"] = {}
for path in job.get("open", []):
    try:
        with open(path, "rb") as fh:
            fh.read(1)
        out["open"][path] = "ok"
    except OSError as exc:
        out["open"][path] = errno_name(exc)
out["connect"] = {}
for path in job.get("connect", []):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        out["connect"][path] = "ok"
    except OSError as exc:
        out["connect"][path] = errno_name(exc)
    finally:
        s.close()
out["cli"] = {}
for name, argv in job.get("cli", {}).items():
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            rc = cli_main(argv)
        except SystemExit as exc:
            rc = exc.code
    out["cli"][name] = {"rc": rc, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
print(json.dumps(out))
"""


def venv_site() -> str:
    """The running interpreter's site-packages (the venv's)."""
    return sysconfig.get_paths()["purelib"]


def _interpreter_candidates() -> list[str]:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = [sys.executable]
    for folder in ("/usr/bin", "/usr/local/bin", "/bin"):
        found.append(os.path.join(folder, f"python{version}"))
    unique: dict[str, str] = {}
    for path in found:
        if os.path.exists(path):
            unique.setdefault(os.path.realpath(path), path)
    return list(unique.values())


def _as_user(user: str, argv: list[str], home: str) -> list[str]:
    runuser = shutil.which("runuser", path=SYSTEM_PATHS)
    assert runuser is not None
    env = [
        f"PATH={SYSTEM_PATHS}",
        f"HOME={home}",
        "PYTHONDONTWRITEBYTECODE=1",
        "PYTHONNOUSERSITE=1",
        "OMP_NUM_THREADS=1",
    ]
    return [runuser, "-u", user, "--", "/usr/bin/env", "-i", *env, *argv]


def interpreter_for(user: str, home: str) -> str | None:
    """A Python of this interpreter's version that ``user`` can execute (the venv's own
    when its base interpreter is readable by them), or None."""
    want = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in _interpreter_candidates():
        probe = [candidate, "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]
        done = subprocess.run(
            _as_user(user, probe, home),
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
            cwd="/",
        )
        if done.returncode == 0 and done.stdout.strip() == want:
            return candidate
    return None


def start_as(user: str, interpreter: str, job: dict[str, Any], home: str) -> subprocess.Popen[str]:
    """Start :data:`USER_SCRIPT` as ``user``; read its result with :func:`result_of`."""
    argv = [interpreter, "-c", USER_SCRIPT, json.dumps({"site": venv_site(), **job})]
    return subprocess.Popen(
        _as_user(user, argv, home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )


def result_of(proc: subprocess.Popen[str], timeout: float = 110.0) -> dict[str, Any]:
    """The JSON result of a :func:`start_as` process.

    Raises:
        AssertionError: it failed or printed no JSON.
    """
    stdout, stderr = proc.communicate(timeout=timeout)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}:\n{stdout}\n{stderr}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- addresses and ports -------------------------------------------------------------


def _is_local(address: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def ipv6_loopback() -> bool:
    """Whether ``::1`` can be bound here (IPv6 may be disabled in a container)."""
    if not socket.has_ipv6:
        return False
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            return False
    return True


def primary_ipv4() -> str | None:
    """A non-loopback IPv4 address of this host (bindable here, so ours), or None.

    The UDP ``connect`` only picks the source address the routing table would use; it
    sends nothing.
    """
    candidates: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        try:
            udp.connect(("10.254.254.254", 9))
            candidates.append(udp.getsockname()[0])
        except OSError:
            pass
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            candidates.append(str(info[4][0]))
    for address in candidates:
        ip = ipaddress.ip_address(address)
        if not (ip.is_loopback or ip.is_unspecified or ip.is_link_local) and _is_local(address):
            return address
    return None


def tcp_port(daemon: Daemon, timeout: float = 60.0) -> int:
    """The TCP port a daemon logged for its ``--listen`` (``listening on tcp ... port=N``)."""
    return daemon.bound_port("tcp", timeout=timeout)


# -- TLS -----------------------------------------------------------------------------


class PkiUnavailableError(RuntimeError):
    """Neither the ``cryptography`` package nor the ``openssl`` command is available."""


@dataclass(frozen=True)
class Pki:
    """PEM files of a throwaway CA, a server certificate and two client certificates:
    ``client`` (CN :data:`CLIENT_NAME`) and ``stranger`` (CN :data:`STRANGER_NAME`)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path


def make_pki(folder: Path, addresses: list[str]) -> Pki:
    """A CA, a server certificate for :data:`TLS_NAME`, ``localhost`` and ``addresses``,
    and two client certificates, all signed by the CA (EC P-256, valid for a day).

    Uses the ``cryptography`` package, else the ``openssl`` command.

    Raises:
        PkiUnavailableError: neither is available.
    """
    folder.mkdir(mode=0o700)
    pki = Pki(
        ca=folder / "ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        client_cert=folder / "client.pem",
        client_key=folder / "client.key",
        stranger_cert=folder / "stranger.pem",
        stranger_key=folder / "stranger.key",
    )
    try:
        import cryptography  # noqa: F401
    except ImportError:
        openssl = shutil.which("openssl", path=SYSTEM_PATHS)
        if openssl is None:
            raise PkiUnavailableError(
                "neither the cryptography package nor the openssl command is available"
            ) from None
        _pki_openssl(openssl, folder, pki, addresses)
    else:
        _pki_cryptography(pki, addresses)
    return pki


def _pki_cryptography(pki: Pki, addresses: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> Any:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name(f"weightcache test CA {uuid.uuid4().hex[:8]}")
    ca = (
        builder(ca_name, ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = [x509.DNSName(TLS_NAME), x509.DNSName("localhost")]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    leaves: tuple[tuple[Path, Path, str, x509.ObjectIdentifier, list[x509.GeneralName]], ...] = (
        (pki.server_cert, pki.server_key, "weightcache daemon", ExtendedKeyUsageOID.SERVER_AUTH,
         sans),
        (pki.client_cert, pki.client_key, CLIENT_NAME, ExtendedKeyUsageOID.CLIENT_AUTH, []),
        (pki.stranger_cert, pki.stranger_key, STRANGER_NAME, ExtendedKeyUsageOID.CLIENT_AUTH, []),
    )  # fmt: skip
    for cert_path, key_path, common, usage, alt in leaves:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            builder(name(common), ca_name, key)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if alt:
            cert = cert.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert_path.write_bytes(
            cert.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        )
        write_key(key_path, key)
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))


def _pki_openssl(openssl: str, folder: Path, pki: Pki, addresses: list[str]) -> None:
    def run(*args: str) -> None:
        done = subprocess.run(
            [openssl, *args], capture_output=True, text=True, check=False, timeout=60
        )
        assert done.returncode == 0, f"openssl {' '.join(args)}:\n{done.stderr}"

    ec_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca_key = folder / "ca.key"
    run(
        "req", "-x509", *ec_key, "-keyout", str(ca_key), "-out", str(pki.ca), "-days", "1",
        "-subj", f"/CN=weightcache test CA {uuid.uuid4().hex[:8]}",
        "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    sans = ",".join([f"DNS:{TLS_NAME}", "DNS:localhost", *(f"IP:{a}" for a in addresses)])
    leaves = (
        (pki.server_cert, pki.server_key, "weightcache daemon", "serverAuth",
         f"subjectAltName={sans}\n"),
        (pki.client_cert, pki.client_key, CLIENT_NAME, "clientAuth", ""),
        (pki.stranger_cert, pki.stranger_key, STRANGER_NAME, "clientAuth", ""),
    )  # fmt: skip
    for cert_path, key_path, common, usage, alt in leaves:
        csr = key_path.with_suffix(".csr")
        ext = key_path.with_suffix(".ext")
        ext.write_text(f"basicConstraints=critical,CA:FALSE\nextendedKeyUsage={usage}\n{alt}")
        run("req", *ec_key, "-keyout", str(key_path), "-out", str(csr),
            "-subj", f"/CN={common}")  # fmt: skip
        run(
            "x509", "-req", "-in", str(csr), "-CA", str(pki.ca), "-CAkey", str(ca_key),
            "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "1",
            "-extfile", str(ext), "-out", str(cert_path),
        )  # fmt: skip


# -- requests ------------------------------------------------------------------------


def acquire_request(
    model_dir: str | os.PathLike[str],
    *,
    ttl: float | None = None,
    request_id: str | None = None,
    pid: int | None = None,
) -> pb.AcquireRequest:
    """An AcquireRequest for a checkpoint, fingerprinted as ``weightcache.load`` does."""
    checkpoint = weightcache.open_checkpoint(model_dir)
    fp = weightcache.compute_fingerprint(checkpoint, weightcache.Recipe(), weightcache.Placement())
    request = pb.AcquireRequest(
        request_id=uuid.uuid4().hex if request_id is None else request_id,
        fingerprint=fingerprint_pb(fp),
        checkpoint_path=str(checkpoint.root),
        pid=os.getpid() if pid is None else pid,
    )
    if ttl is not None:
        duration = duration_pb2.Duration()
        duration.FromNanoseconds(round(ttl * 1e9))
        request.ttl.CopyFrom(duration)
        request.ttl.SetInParent()  # present even when zero
    return request


def stop_together(daemons: list[Daemon], timeout: float = 60.0) -> None:
    """SIGTERM every running daemon at once and wait for each to exit, so that stopping
    several costs one exit; the pool's close() then finds them stopped (one signal each)."""
    running = [d for d in daemons if d.proc.poll() is None]
    for daemon in running:
        daemon.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for daemon in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.proc.wait(max(0.1, deadline - time.monotonic()))


def write_go(path: Path, job: dict[str, Any]) -> None:
    """Release the :func:`start_as` processes waiting on ``path``, with more of their job."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(job))
    os.chmod(tmp, 0o644)
    os.rename(tmp, path)
