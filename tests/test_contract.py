"""The contract as other languages take it: the .proto files the wheel ships, the vendored
google.rpc files, and the compatibility check against the last released contract."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2, status_pb2

import weightcache
from weightcache.core.contract import PROTO_FILES

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
# What the wheel ships of protos/: everything but the released image.
SHIPPED_DIRS = ("weightcache", "google")


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for top in SHIPPED_DIRS
        for path in sorted((folder / top).rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_the_package_ships_the_contract_as_it_is_in_protos() -> None:
    shipped = _tree(weightcache.proto_path())

    assert shipped == _tree(PROTOS)
    assert set(PROTO_FILES) <= set(shipped)
    assert "google/rpc/LICENSE" in shipped


def test_an_installed_wheel_holds_the_contract(tmp_path: Path) -> None:
    # Built from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    source, wheels, target = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for name in ("client", "cache_service"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("weightcache-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"weightcache/protos/{name}" for name in PROTO_FILES} <= names

    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", target, wheel],
        check=True,
        timeout=300,
    )
    code = "import weightcache; print(weightcache.proto_path())"
    found = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert Path(found) == target / "weightcache" / "protos"
    assert _tree(Path(found)) == _tree(PROTOS)


def _compiled(name: str, tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    out = tmp_path / "set.binpb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTOS}",
            f"--descriptor_set_out={out}",
            name,
        ],
        check=True,
        timeout=60,
    )
    (file,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    return file


def _without_json_names(message: descriptor_pb2.DescriptorProto) -> descriptor_pb2.DescriptorProto:
    """``message`` as the Python stubs embed it: protoc fills json_name only in a
    descriptor set."""
    for field in message.field:
        field.ClearField("json_name")
    for nested in message.nested_type:
        _without_json_names(nested)
    return message


@pytest.mark.parametrize(
    ("name", "module", "messages"),
    [
        ("google/rpc/status.proto", status_pb2, ["Status"]),
        ("google/rpc/error_details.proto", error_details_pb2, ["ErrorInfo"]),
    ],
)
def test_the_vendored_error_protos_decode_what_the_sdk_encodes(
    name: str, module: object, messages: list[str], tmp_path: Path
) -> None:
    """The vendored files define the messages the daemon sends as googleapis-common-protos
    (which the daemon and the SDK use) defines them."""
    ours = {m.name: _without_json_names(m) for m in _compiled(name, tmp_path).message_type}
    theirs = descriptor_pb2.FileDescriptorProto.FromString(
        module.DESCRIPTOR.serialized_pb  # type: ignore[attr-defined]
    )

    assert theirs.package == "google.rpc"
    wanted = [m for m in theirs.message_type if m.name in messages]
    assert [m.name for m in wanted] == messages
    for message in wanted:
        assert ours[message.name] == message
