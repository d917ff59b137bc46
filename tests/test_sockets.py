"""The one socket-naming rule (``weightcache.core.sockets``), read in fresh processes with
the environment and the uid each branch of the rule depends on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import weightcache
from tests.support import child_env
from weightcache.core.sockets import DeviceLike, parse_device

NOBODY = 65534
UUID = "GPU-8f3c1a2b-0000-4000-8000-000000000001"
#: Prints default_socket(DEVICE) or the exception's class and message.
PROBE = """
import sys, weightcache
device = sys.argv[1]
try:
    print(weightcache.default_socket(int(device) if device.isdigit() else device))
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def _rule(device: str, uid: int | None = None, **env: str) -> str:
    """``default_socket(device)`` in a fresh interpreter as ``uid`` (root runs it through
    setpriv), with ``env`` on top of an environment without the rule's variables."""
    base = child_env()
    for name in ("WEIGHTCACHE_SOCKET", "WEIGHTCACHE_RUNTIME_DIR", "XDG_RUNTIME_DIR"):
        base.pop(name, None)
    prefix: list[str] = []
    if uid is not None and uid != os.geteuid():
        setpriv = shutil.which("setpriv")
        if os.geteuid() != 0 or setpriv is None:
            pytest.skip("needs root and setpriv(1) to read the rule as another user")
        prefix = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    done = subprocess.run(
        [*prefix, sys.executable, "-c", PROBE, device],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
        check=True,
        cwd="/",
    )
    return done.stdout.rstrip("\n")


def test_cpu_as_root_is_in_run() -> None:
    if os.geteuid() != 0:
        pytest.skip("reads the root branch of the rule")
    assert _rule("cpu") == "/run/weightcache/cpu.sock"


def test_cpu_as_another_user_is_in_the_xdg_runtime_dir() -> None:
    assert _rule("cpu", NOBODY, XDG_RUNTIME_DIR="/run/user/4242") == (
        "/run/user/4242/weightcache/cpu.sock"
    )


def test_cpu_as_another_user_without_xdg_is_in_tmp_by_uid() -> None:
    assert _rule("cpu", NOBODY) == f"/tmp/weightcache-{NOBODY}/cpu.sock"


def test_runtime_dir_variable_wins_over_root_and_xdg() -> None:
    for uid in (os.geteuid(), NOBODY):
        assert _rule("cpu", uid, WEIGHTCACHE_RUNTIME_DIR="/srv/wc", XDG_RUNTIME_DIR="/x") == (
            "/srv/wc/cpu.sock"
        )


def test_socket_variable_wins_for_every_device_without_reading_cuda() -> None:
    env = {"WEIGHTCACHE_SOCKET": "/srv/one.sock", "WEIGHTCACHE_RUNTIME_DIR": "/srv/wc"}

    assert [_rule(d, None, **env) for d in ("cpu", "cuda:0", "3", UUID)] == ["/srv/one.sock"] * 4


def test_a_gpu_uuid_names_its_socket_without_cuda() -> None:
    env = {"WEIGHTCACHE_RUNTIME_DIR": "/srv/wc"}

    assert _rule(UUID, None, **env) == f"/srv/wc/{UUID}.sock"
    assert _rule(f"cuda:{UUID}", None, **env) == f"/srv/wc/{UUID}.sock"
    assert _rule("MIG-0a1b", None, **env) == "/srv/wc/MIG-0a1b.sock"


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the refusal without a GPU")
@pytest.mark.parametrize(("device", "shown"), [("cuda:0", "cuda:0"), ("2", "cuda:2")])
def test_a_gpu_index_without_cuda_is_device_not_visible(device: str, shown: str) -> None:
    out = _rule(device, WEIGHTCACHE_RUNTIME_DIR="/srv/wc", CUDA_VISIBLE_DEVICES="")

    assert out == (
        f"DeviceNotVisibleError device {shown}: torch {torch.__version__} sees no CUDA/ROCm "
        "device, so its UUID (which names its daemon's socket) cannot be read "
        "(CUDA_VISIBLE_DEVICES=)"
    )


@pytest.mark.parametrize(
    ("device", "parsed"),
    [
        ("cpu", "cpu"),
        (torch.device("cpu"), "cpu"),
        ("cuda", "cuda"),
        (torch.device("cuda", 1), "cuda:1"),
        ("cuda:01", "cuda:1"),
        ("7", "cuda:7"),
        (0, "cuda:0"),
        (UUID, UUID),
        (f"cuda:{UUID}", UUID),
    ],
    ids=str,
)
def test_device_forms(device: DeviceLike, parsed: str) -> None:
    assert parse_device(device) == parsed


@pytest.mark.parametrize("device", ["mps", "cuda:x", "", "gpu0", -1, True])
def test_a_device_that_names_none_is_a_value_error(
    device: DeviceLike, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WEIGHTCACHE_SOCKET", raising=False)
    with pytest.raises(ValueError, match=r"^device "):
        weightcache.default_socket(device)


def test_the_public_default_socket_is_the_rule() -> None:
    from weightcache.core import sockets

    assert weightcache.default_socket is sockets.default_socket
