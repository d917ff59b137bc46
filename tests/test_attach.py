"""Attaching from a worker process gives bitwise the tensors a disk load gives."""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Literal

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightcache
from tests.security_support import acquire_request
from tests.support import (
    Checkpoints,
    Daemon,
    DaemonPool,
    WorkerPool,
    assert_attached,
    assert_bitwise_equal,
    flipped,
    get_model,
    service_stub,
)
from weightcache.core.dtypes import SUB_BYTE, TORCH_DTYPES
from weightcache.v1 import weight_cache_service_pb2 as pb

Layout = Literal["single", "sharded"]
EXPECTED_DTYPES = {
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.bool,
    torch.int64,
}


@pytest.fixture(scope="module")
def daemon(module_daemons: DaemonPool, checkpoints: Checkpoints) -> Daemon:
    """Holds ``single`` and ``sharded`` as stored."""
    return module_daemons.start([checkpoints.single, checkpoints.sharded])


@pytest.fixture(scope="module")
def f16_daemon(module_daemons: DaemonPool, checkpoints: Checkpoints) -> Daemon:
    """Holds ``single`` and ``sharded`` with floating tensors cast to F16."""
    return module_daemons.start([checkpoints.single, checkpoints.sharded], dtype="F16")


def _folder(checkpoints: Checkpoints, layout: Layout) -> Path:
    return checkpoints.single if layout == "single" else checkpoints.sharded


def test_checkpoints_cover_the_required_tensor_kinds(checkpoints: Checkpoints) -> None:
    disk = weightcache.load_from_disk(checkpoints.sharded).tensors
    assert {t.dtype for t in disk.values()} == EXPECTED_DTYPES
    assert {tuple(t.shape) for t in disk.values()} >= {(0, 4), ()}
    assert_bitwise_equal(disk, checkpoints.tensors)
    assert_bitwise_equal(weightcache.load_from_disk(checkpoints.single).tensors, disk)


CASES = [(layout, mode) for mode in ("zero_copy", "copy") for layout in ("single", "sharded")]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_attach_is_bitwise_the_disk_load(
    daemon: Daemon,
    workers: WorkerPool,
    checkpoints: Checkpoints,
    tmp_path: Path,
    case: tuple[Layout, str],
) -> None:
    layout, mode = case
    folder = _folder(checkpoints, layout)
    worker = workers.start()

    reply = worker.load(folder, socket=daemon.socket, mode=mode, ttl=1.5, dump=tmp_path / "w")

    assert_attached(reply)
    assert reply["model"] == layout
    disk = weightcache.load_from_disk(folder)
    assert reply["names"] == list(disk.tensors)
    assert_bitwise_equal(load_file(tmp_path / "w"), disk.tensors)
    if mode == "zero_copy":
        assert reply["lease"] == {"ttl": 1.5, "validity": 1.0}
        assert reply["in_shared_memory"] is True
    else:
        assert reply["lease"] is None
        assert reply["in_shared_memory"] is False


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_attach_with_dtype_recipe_is_bitwise_the_disk_load(
    f16_daemon: Daemon,
    workers: WorkerPool,
    checkpoints: Checkpoints,
    tmp_path: Path,
    layout: Layout,
) -> None:
    folder = _folder(checkpoints, layout)
    worker = workers.start()

    reply = worker.load(folder, socket=f16_daemon.socket, dtype="F16", dump=tmp_path / "w")

    assert_attached(reply)
    assert reply["model"].startswith(layout)
    disk = weightcache.load_from_disk(folder, dtype="F16").tensors
    assert_bitwise_equal(load_file(tmp_path / "w"), disk)
    cast = {n for n, t in checkpoints.tensors.items() if t.dtype.is_floating_point}
    for name, tensor in disk.items():
        stored = checkpoints.tensors[name].dtype
        if stored == torch.float8_e4m3fn:
            assert tensor.dtype == stored, name  # fp8 is never cast
        elif name in cast:
            assert tensor.dtype == torch.float16, name
        else:
            assert tensor.dtype == stored, name
    assert get_model(f16_daemon.socket, reply["model"]).recipe.dtype == "F16"


def test_two_workers_share_bytes_and_writes_stay_private(
    daemon: Daemon, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    folder = checkpoints.sharded
    disk = weightcache.load_from_disk(folder).tensors
    first, second, later = workers.start(), workers.start(), workers.start()

    # Both attach and hold their leases at the same time.
    for worker, name in ((first, "a0"), (second, "b0")):
        reply = worker.load(folder, socket=daemon.socket, ttl=1.5, dump=tmp_path / name)
        assert_attached(reply)
        assert reply["in_shared_memory"] is True
    assert get_model(daemon.socket, "sharded").lease_count == 2
    assert_bitwise_equal(load_file(tmp_path / "a0"), disk)
    assert_bitwise_equal(load_file(tmp_path / "b0"), load_file(tmp_path / "a0"))

    # The first writes to every tensor; the write is real in its own process...
    assert first.request("invert", key="w")["ok"]
    assert first.request("dump", key="w", path=str(tmp_path / "a1"))["ok"]
    assert_bitwise_equal(load_file(tmp_path / "a1"), {n: flipped(t) for n, t in disk.items()})

    # ...but the second, mapped before the write, still reads the original bytes...
    assert second.request("dump", key="w", path=str(tmp_path / "b1"))["ok"]
    assert_bitwise_equal(load_file(tmp_path / "b1"), disk)

    # ...and so does the daemon's next attach.
    reply = later.load(folder, socket=daemon.socket, dump=tmp_path / "c0")
    assert_attached(reply)
    assert_bitwise_equal(load_file(tmp_path / "c0"), disk)


# -- every dtype safetensors and torch share (issue 9, item 11) -----------------------


def _safetensors_dtypes() -> dict[str, torch.dtype]:
    """Every torch dtype that safetensors writes and reads back, by its safetensors name;
    the sub-byte ones (refused by name, see ``MALFORMED["sub-byte-dtype"]``) left out."""
    found = {}
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about its experimental dtypes
        path = Path(tmp) / "t.safetensors"
        for dtype in sorted(dtypes, key=str):
            try:
                save_file({"t": torch.empty(0, dtype=dtype)}, str(path))
                assert load_file(path)["t"].dtype == dtype
            except Exception:
                continue  # not a dtype safetensors handles
            raw = path.read_bytes()
            name = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["t"]["dtype"]
            if name not in SUB_BYTE:
                found[name] = dtype
    return found


SAFETENSORS_DTYPES = _safetensors_dtypes()


def _dtype_tensors(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        # A bool byte other than 0 or 1 is not a bool; torch compares them as different.
        bits = torch.randint(0, 2, (3 * 5,), dtype=torch.uint8, generator=gen)
        return {"t": bits.view(dtype).reshape(3, 5), "s": torch.ones((), dtype=dtype)}
    raw = torch.randint(0, 256, (3 * 5 * dtype.itemsize + dtype.itemsize,), generator=gen)
    raw = raw.to(torch.uint8)
    values = raw.view(dtype)
    return {"t": values[:15].reshape(3, 5), "s": values[15].clone()}


@pytest.fixture(scope="module")
def dtype_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One single-file checkpoint per supported dtype, written by safetensors itself."""
    base = tmp_path_factory.mktemp("dtypes")
    folders = {}
    for seed, (name, dtype) in enumerate(sorted(SAFETENSORS_DTYPES.items())):
        folder = base / name.lower()
        folder.mkdir()
        save_file(_dtype_tensors(dtype, seed), str(folder / "model.safetensors"))
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def dtype_daemon(module_daemons: DaemonPool, dtype_folders: dict[str, Path]) -> Daemon:
    """Holds every checkpoint of :func:`dtype_folders` as stored."""
    return module_daemons.start(list(dtype_folders.values()))


@pytest.mark.parametrize("name", sorted(SAFETENSORS_DTYPES))
def test_every_supported_dtype_round_trips_bitwise_on_both_paths(
    dtype_daemon: Daemon,
    dtype_folders: dict[str, Path],
    workers: WorkerPool,
    tmp_path: Path,
    name: str,
) -> None:
    folder = dtype_folders[name]
    expected = load_file(folder / "model.safetensors")
    assert expected["t"].dtype == SAFETENSORS_DTYPES[name] == TORCH_DTYPES[name]

    assert_bitwise_equal(weightcache.load_from_disk(folder).tensors, expected)
    reply = workers.start().load(folder, socket=dtype_daemon.socket, dump=tmp_path / "w")
    assert_attached(reply)
    assert reply["model"] == name.lower()
    assert_bitwise_equal(load_file(tmp_path / "w"), expected)


def test_supported_dtypes_are_those_safetensors_and_torch_share() -> None:
    assert TORCH_DTYPES == SAFETENSORS_DTYPES
    assert {"C64", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0"} <= set(TORCH_DTYPES)


@pytest.mark.parametrize("tensor_format", [pb.TENSOR_FORMAT_VIEWS, pb.TENSOR_FORMAT_TABLE])
def test_an_acquire_reply_gives_each_tensors_byte_length_for_every_dtype(
    dtype_daemon: Daemon, dtype_folders: dict[str, Path], tensor_format: pb.TensorFormat
) -> None:
    for name, folder in sorted(dtype_folders.items()):
        raw = (folder / "model.safetensors").read_bytes()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        # The bytes safetensors itself gives each tensor, from its data_offsets.
        want = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()}
        request = acquire_request(folder)
        request.tensor_format = tensor_format
        with service_stub(dtype_daemon.socket) as stub:
            reply = stub.Acquire(request)
            stub.Release(pb.ReleaseRequest(lease_id=reply.lease.lease_id))
        if tensor_format == pb.TENSOR_FORMAT_TABLE:
            got = dict(zip(reply.tensor_table.names, reply.tensor_table.nbytes, strict=True))
        else:
            got = {v.name: v.nbytes for v in reply.tensors}
        assert got == want, name
        assert got["t"] == 15 * TORCH_DTYPES[name].itemsize
