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
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", wheels, source],
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


def test_python_takes_google_rpc_from_googleapis_common_protos() -> None:
    """The vendored files are for other languages: no google.rpc stubs are generated into
    this repository, and the SDK's come from the googleapis-common-protos package."""
    assert not (ROOT / "client" / "google").exists()
    assert not list((ROOT / "client").rglob("status_pb2.py"))
    assert "site-packages" in Path(status_pb2.__file__).parts


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


BUF = Path(sys.executable).parent / "buf"
RELEASED = PROTOS / "released" / "weightcache.v1.binpb"
CONTRACT = "weightcache/v1/weight_cache_service.proto"


def _breaking(tmp_path: Path, edit: tuple[str, str] | None) -> subprocess.CompletedProcess[str]:
    """`buf breaking` (as `make lint` runs it) on a copy of the contract with one edit."""
    shutil.copy2(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(PROTOS, tmp_path / "protos")
    if edit is not None:
        path = tmp_path / "protos" / CONTRACT
        text = path.read_text()
        assert text.count(edit[0]) == 1
        path.write_text(text.replace(*edit))
    return subprocess.run(
        [BUF, "breaking", "--against", RELEASED],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_contract_is_compatible_with_the_released_one(tmp_path: Path) -> None:
    result = _breaking(tmp_path, None)

    assert (result.returncode, result.stdout) == (0, "")


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        (
            ("  int64 byte_offset = 5;", "  int64 byte_offset = 9;"),
            'Previously present field "5" with name "byte_offset" on message "TensorView" '
            "was deleted.",
        ),
        (
            ("  ERROR_REASON_MODEL_NOT_FOUND = 2;", "  ERROR_REASON_MODEL_MISSING = 2;"),
            'Enum value "2" on enum "ErrorReason" changed name from '
            '"ERROR_REASON_MODEL_NOT_FOUND" to "ERROR_REASON_MODEL_MISSING".',
        ),
    ],
    ids=["renumbered-field", "renamed-reason"],
)
def test_a_breaking_change_of_the_contract_fails_the_check(
    tmp_path: Path, edit: tuple[str, str], complaint: str
) -> None:
    result = _breaking(tmp_path, edit)

    assert result.returncode != 0
    assert complaint in result.stdout
