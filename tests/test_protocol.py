"""weightcache.core.protocol: each domain object survives encoding and decoding unchanged,
and requests are refused while decoding with the field named."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.support import Checkpoints, run_cli
from weightcache._handles import build_views
from weightcache.core.checkpoint import INDEX_FILE, MAX_FILES, FileIdentity, open_checkpoint
from weightcache.core.dtypes import TORCH_DTYPES
from weightcache.core.errors import HandleError, InvalidArgumentError
from weightcache.core.fingerprint import (
    DEFAULT_LEVEL,
    Fingerprint,
    compute_fingerprint,
    pending_fingerprint,
)
from weightcache.core.plugins import PluginStep
from weightcache.core.protocol import (
    MAX_COMPONENTS,
    acquire_request_pb,
    acquire_response_pb,
    acquisition_from_pb,
    duration_from_pb,
    duration_pb,
    fingerprint_from_pb,
    fingerprint_pb,
    grant_from_pb,
    lease_from_pb,
    lease_pb,
    lease_status_from_pb,
    lease_status_pb,
    level_from_pb,
    level_pb,
    model_from_pb,
    model_pb,
    placement_from_pb,
    placement_pb,
    progress_from_pb,
    progress_pb,
    recipe_from_pb,
    recipe_pb,
    server_info_from_pb,
    server_info_pb,
    storage_from_pb,
    storage_pb,
    tensor_view_from_pb,
    tensor_view_pb,
    tensor_views_pb,
    timestamp_from_pb,
    timestamp_pb,
    view_columns_from_pb,
    view_nbytes,
)
from weightcache.core.recipe import Placement, Recipe
from weightcache.core.records import (
    Acquisition,
    CudaIpcHandle,
    Environment,
    Grant,
    LeaseInfo,
    LeaseStatus,
    LoadProgress,
    ModelInfo,
    ModelState,
    ServerInfo,
    SharedMemoryHandle,
    TensorFormat,
)
from weightcache.core.tp import TPPlan
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache_service.arena import plan_slots

STATES: tuple[ModelState, ...] = ("loading", "ready", "failed", "evicting")
#: Epoch seconds and durations that a nanosecond count holds exactly.
WHEN = 1_764_547_200.125
PLACEMENT = Placement(tp_rank=1, tp_size=2)
RECIPE = Recipe(
    dtype="BF16",
    tp_plan=TPPlan((("layers.*.attn", "colwise"), ("layers.*.mlp", "rowwise"))),
    plugins=(PluginStep("fuse_qkv", (("a", "1"), ("b", "x=y"))), PluginStep("noop")),
)


@pytest.fixture(scope="module")
def fingerprint(checkpoints: Checkpoints) -> Fingerprint:
    with open_checkpoint(str(checkpoints.sharded)) as checkpoint:
        return compute_fingerprint(checkpoint, Recipe(dtype="F32"), Placement(), "full")


def _model(fp: Fingerprint, state: ModelState = "ready") -> ModelInfo:
    return ModelInfo(
        name="sharded-tp1of2-bf16",
        state=state,
        fingerprint=fp,
        path="/models/sharded",
        recipe=RECIPE,
        placement=PLACEMENT,
        size_bytes=1 << 20,
        tensor_count=9,
        lease_count=2,
        create_time=WHEN,
        progress=LoadProgress(1000, 1024, 8, 9),
        error="",
        load_seconds=3.125 if state == "ready" else None,
        metadata={"format": "pt"},
    )


def test_times_round_trip() -> None:
    assert timestamp_from_pb(timestamp_pb(WHEN)) == WHEN
    assert duration_from_pb(duration_pb(30.0)) == 30.0


def test_fingerprint_round_trips(fingerprint: Fingerprint) -> None:
    for level in ("layout", "sampled", "full"):
        assert level_from_pb(level_pb(level)) == level
    assert level_from_pb(pb.FINGERPRINT_LEVEL_UNSPECIFIED) == "full" == DEFAULT_LEVEL

    decoded = fingerprint_from_pb(fingerprint_pb(fingerprint))

    assert decoded == fingerprint
    assert decoded.differing(fingerprint) == []
    assert list(decoded.components) == sorted(fingerprint.components)


def test_recipe_and_placement_round_trip() -> None:
    assert recipe_from_pb(recipe_pb(RECIPE)) == RECIPE
    assert recipe_from_pb(recipe_pb(Recipe())) == Recipe()
    assert placement_from_pb(placement_pb(PLACEMENT)) == PLACEMENT
    assert placement_from_pb(pb.Placement()) == Placement(0, 1)


def test_a_model_reports_the_recipe_as_resolved(checkpoints: Checkpoints) -> None:
    with open_checkpoint(str(checkpoints.single)) as checkpoint:
        pipeline = Recipe(dtype="BF16").build(checkpoint, Placement())

    resolved = pipeline.resolved()

    assert resolved == Recipe(dtype="BF16")
    assert recipe_pb(resolved) == pb.Recipe(dtype="BF16")


def test_models_round_trip(fingerprint: Fingerprint) -> None:
    for state in STATES:
        model = _model(fingerprint, state)
        assert model_from_pb(model_pb(model)) == model
    assert not model_pb(_model(fingerprint, "loading")).HasField("load_duration")
    progress = LoadProgress(5, 10, 1, 2)
    assert progress_from_pb(progress_pb(progress)) == progress


def test_a_pending_fingerprint_is_read_only_for_a_model_loading_or_failed(
    checkpoints: Checkpoints,
) -> None:
    with open_checkpoint(str(checkpoints.sharded)) as checkpoint:
        pipeline = Recipe().build(checkpoint, Placement())
        pending = pending_fingerprint(checkpoint, pipeline, Placement())
        complete = compute_fingerprint(checkpoint, pipeline, Placement(), "full")
    assert pending.pending and not complete.pending
    assert (pending.digest, pending.level) == ("", "full")
    assert list(pending.components) == ["format", "layout", "placement", "recipe"]
    assert pending.may_become(complete) and not complete.may_become(pending)
    readable: tuple[ModelState, ...] = ("loading", "failed")
    for state in readable:
        model = _model(pending, state)
        assert model_from_pb(model_pb(model)) == model
    refused: tuple[ModelState, ...] = ("ready", "evicting")
    for state in refused:
        with pytest.raises(InvalidArgumentError) as caught:
            model_from_pb(model_pb(_model(pending, state)))
        assert caught.value.metadata == {"field": "fingerprint.digest"}


def test_leases_round_trip() -> None:
    lease = LeaseInfo("ab" * 16, "single", 30.0, WHEN, "cd" * 16)
    statuses = [
        LeaseStatus("l1", "active", expire_time=WHEN),
        LeaseStatus("l2", "revoking", expire_time=WHEN, revoke_deadline=WHEN + 30.0),
        LeaseStatus("l3", "not_found"),
    ]

    assert lease_from_pb(lease_pb(lease)) == lease
    assert [lease_status_from_pb(lease_status_pb(s)) for s in statuses] == statuses
    assert lease_status_pb(statuses[2]).state == pb.LEASE_STATE_NOT_FOUND


def test_arena_handles_and_views_round_trip() -> None:
    slots, _ = plan_slots([("w", "BF16", (4, 3, 2)), ("b", "F32", (5,)), ("s", "I64", ())])
    views = [slot.view() for slot in slots]
    shm = SharedMemoryHandle("/dev/shm/weightcache-x", 4096)
    cuda = CudaIpcHandle("GPU-00000000-1111-2222-3333-444444444444", bytes(range(64)), 8192)

    assert [tensor_view_from_pb(tensor_view_pb(v)) for v in views] == views
    assert views[0].stride == (6, 2, 1)
    assert storage_from_pb(storage_pb(shm)) == shm
    assert storage_from_pb(storage_pb(cuda)) == cuda
    with pytest.raises(HandleError):
        storage_from_pb(pb.StorageHandle())


def test_acquire_round_trips(fingerprint: Fingerprint) -> None:
    want = Acquisition(
        "req-1", fingerprint, "/models/sharded", 12.5, Environment("1.0", "2.5"), 4242
    )
    slots, size = plan_slots([("w", "F32", (2, 2))])
    grant = Grant(
        lease=LeaseInfo("l1", "sharded", 12.5, WHEN, "i1"),
        model=_model(fingerprint),
        storage=SharedMemoryHandle("/dev/shm/weightcache-y", size),
        tensors=tuple(slot.view() for slot in slots),
        environment=Environment("1.0", "2.5", "cpu_shm", ""),
    )

    assert acquisition_from_pb(acquire_request_pb(want)) == want
    no_ttl = Acquisition("", fingerprint, "", None, Environment(), 0)
    assert acquisition_from_pb(acquire_request_pb(no_ttl)) == no_ttl
    assert grant_from_pb(acquire_response_pb(grant)) == grant
    # The servicer copies in views encoded at a model's first Acquire: the same message.
    encoded = tensor_views_pb(grant.tensors)
    assert acquire_response_pb(grant, encoded) == acquire_response_pb(grant)
    assert list(encoded.tensors) == [tensor_view_pb(v) for v in grant.tensors]


def test_acquire_by_files_round_trips(fingerprint: Fingerprint) -> None:
    by_files = Fingerprint("", "full", {"format": "1" * 64, "recipe": "2" * 64})
    files = {
        INDEX_FILE: FileIdentity(1, 2, 3, 4, 5),
        "model.safetensors": FileIdentity(2**64 - 1, 2**64 - 2, 2**63 - 1, -1, 2**63 - 1),
    }
    want = Acquisition("r", by_files, "/m", None, Environment(), 7, files, "table")

    assert acquisition_from_pb(acquire_request_pb(want)) == want
    unknown = acquire_request_pb(want)
    unknown.tensor_format = 99  # type: ignore[assignment]
    assert acquisition_from_pb(unknown).tensor_format == "views"
    assert acquisition_from_pb(pb.AcquireRequest(fingerprint=fingerprint_pb(fingerprint))) == (
        Acquisition("", fingerprint, "", None, Environment(), 0, {}, "views")
    )


def _grant(fingerprint: Fingerprint) -> Grant:
    slots, size = plan_slots(
        [("w", "BF16", (4, 3, 2)), ("b", "F32", (5,)), ("s", "I64", ()), ("e", "F16", (0, 4))]
    )
    return Grant(
        lease=LeaseInfo("l1", "sharded", 12.5, WHEN, "i1"),
        model=_model(fingerprint),
        storage=SharedMemoryHandle("/dev/shm/weightcache-y", size),
        tensors=tuple(slot.view() for slot in slots),
        environment=Environment("1.0", "2.5", "cpu_shm", ""),
    )


def test_a_tensor_table_holds_the_same_views_as_the_list(fingerprint: Fingerprint) -> None:
    grant = _grant(fingerprint)

    table = acquire_response_pb(grant, tensor_views_pb(grant.tensors, "table"))

    assert not table.tensors
    assert list(table.tensor_table.dtypes) == ["BF16", "F32", "I64", "F16"]
    assert list(table.tensor_table.ranks) == [3, 1, 0, 2]
    assert grant_from_pb(table) == grant
    rows = [v.row(view_nbytes(v)) for v in grant.tensors]
    assert list(view_columns_from_pb(table).rows()) == rows
    assert list(view_columns_from_pb(acquire_response_pb(grant)).rows()) == rows


@pytest.mark.parametrize("tensor_format", ["views", "table"])
def test_views_are_built_where_the_table_says(
    fingerprint: Fingerprint, tensor_format: TensorFormat
) -> None:
    """Column by column (build_views' bulk path): each view's dtype, shape, stride and
    address, a 0-d and an empty view included."""
    grant = _grant(fingerprint)
    reply = acquire_response_pb(grant, tensor_views_pb(grant.tensors, tensor_format))
    base = torch.zeros(grant.storage.size, dtype=torch.uint8)

    columns = view_columns_from_pb(reply)
    views = build_views(base, columns)
    # A shared lease's next load builds them again from the same columns.
    again = build_views(base, columns)

    assert list(views) == list(again) == ["w", "b", "s", "e"]
    for want, got in [(w, v[w.name]) for v in (views, again) for w in grant.tensors]:
        assert (got.dtype, tuple(got.shape), got.stride()) == (
            TORCH_DTYPES[want.dtype],
            want.shape,
            want.stride,
        )
        # storage_offset, not data_ptr: torch says 0 for an empty tensor's address.
        assert got.untyped_storage().data_ptr() == base.data_ptr()
        assert got.storage_offset() * got.itemsize == want.byte_offset


@pytest.mark.parametrize(
    ("spoil", "detail"),
    [
        # Refused while decoding the columns (view_columns_from_pb):
        (lambda t: t.names.append("extra"), "differ in length"),
        (lambda t: t.byte_offsets.pop(), "differ in length"),
        (lambda t: t.shape.pop(), "sum(ranks)"),
        (lambda t: t.stride.append(1), "sum(ranks)"),
        (lambda t: t.ranks.__setitem__(0, 2), "sum(ranks)"),
        (lambda t: t.dtype_index.__setitem__(1, 4), "past the 4 dtypes"),
        # Refused by build_views' column checks, the view at fault then named:
        (lambda t: t.byte_offsets.__setitem__(3, 3), "tensor 'e': misaligned byte_offset 3"),
        (lambda t: t.dtypes.__setitem__(3, "F7"), "tensor 'e': unknown dtype 'F7'"),
        (lambda t: t.shape.__setitem__(3, 6), "tensor 'b': nbytes 20 is not its shape (6,)"),
        (lambda t: t.byte_offsets.__setitem__(1, 1 << 20), "tensor 'b': reaches past the"),
    ],
    ids=[
        "names",
        "offsets",
        "shape",
        "stride",
        "ranks",
        "dtype-index",
        "misaligned",
        "dtype",
        "nbytes",
        "past-the-end",
    ],
)
def test_a_malformed_tensor_table_is_a_handle_error(
    fingerprint: Fingerprint, spoil: Callable[[pb.TensorTable], object], detail: str
) -> None:
    grant = _grant(fingerprint)
    reply = acquire_response_pb(grant, tensor_views_pb(grant.tensors, "table"))
    spoil(reply.tensor_table)
    base = torch.zeros(grant.storage.size, dtype=torch.uint8)

    with pytest.raises(HandleError) as caught:
        build_views(base, view_columns_from_pb(reply))

    assert caught.value.reason == "INVALID_HANDLE"
    assert detail in str(caught.value)


def test_server_info_round_trips() -> None:
    info = ServerInfo(
        "1.0", "weightcache.v1", "2.5", "cuda_ipc", "cuda:0", "GPU-1", 1 << 30, 0, "i1", WHEN
    )

    assert server_info_from_pb(server_info_pb(info)) == info


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.AcquireRequest(request_id="r" * 129, fingerprint=pb.Fingerprint()), "request_id"),
        (pb.AcquireRequest(checkpoint_path="p" * 4097), "checkpoint_path"),
        (pb.AcquireRequest(fingerprint=pb.Fingerprint(digest="A" * 64)), "fingerprint.digest"),
        (
            pb.AcquireRequest(
                fingerprint=pb.Fingerprint(
                    digest="a" * 64,
                    components=[pb.FingerprintComponent()] * (MAX_COMPONENTS + 1),
                )
            ),
            "fingerprint.components",
        ),
        (
            pb.AcquireRequest(fingerprint=pb.Fingerprint(digest="a" * 64), ttl=duration_pb(-1.0)),
            "ttl",
        ),
        # Only an Acquire by file identity may leave the digest out.
        (pb.AcquireRequest(fingerprint=pb.Fingerprint()), "fingerprint.digest"),
        (pb.AcquireRequest(files=[pb.CheckpointFile(name="f")] * (MAX_FILES + 1)), "files"),
        (pb.AcquireRequest(files=[pb.CheckpointFile(name="f" * 4097)]), "files.name"),
    ],
)
def test_acquire_requests_are_checked_while_decoding(
    request_: pb.AcquireRequest, field: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        acquisition_from_pb(request_)

    assert (caught.value.reason, caught.value.metadata) == ("INVALID_ARGUMENT", {"field": field})


def test_an_unknown_level_is_refused_with_its_field() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        level_from_pb(99)

    assert caught.value.metadata == {"field": "fingerprint_level"}


def test_the_numbers_the_contract_and_the_cli_repeat_in_text_match_their_homes() -> None:
    """The proto's and the CLI's help texts repeat three defaults for readers; each has one
    home in the code, and this keeps the text from drifting from it."""
    from pathlib import Path

    from weightcache_service.budget import MemoryBudget
    from weightcache_service.leases import DEFAULT_TTL, MAX_TTL, MIN_TTL
    from weightcache_service.options import ServiceOptions

    proto = Path(__file__).parent.parent / "protos/weightcache/v1/weight_cache_service.proto"
    assert f"Unset means {DEFAULT_TTL:g} s." in proto.read_text()
    assert f"At most {MAX_FILES} files." in proto.read_text()
    assert (MIN_TTL, DEFAULT_TTL, MAX_TTL) == (1.0, 10.0, 300.0)
    shown = run_cli("preload", "--help")
    text = " ".join(shown.stdout.split())  # argparse wraps the help to the terminal
    assert shown.returncode == 0
    assert f"evict --force); default {ServiceOptions.drain_timeout:g}" in text
    assert MemoryBudget.headroom == 256 * 2**20
    assert "leave available (default 256MiB)" in text


def test_every_view_carries_its_byte_length_in_both_formats(fingerprint: Fingerprint) -> None:
    grant = _grant(fingerprint)
    # (4, 3, 2) BF16, (5,) F32, a 0-d I64, an empty (0, 4) F16.
    want = [24 * 2, 5 * 4, 8, 0]

    assert [v.nbytes for v in acquire_response_pb(grant).tensors] == want
    table = acquire_response_pb(grant, tensor_views_pb(grant.tensors, "table"))
    assert list(table.tensor_table.nbytes) == want


@pytest.mark.parametrize("tensor_format", ["views", "table"])
def test_a_view_whose_nbytes_disagrees_with_its_shape_is_a_handle_error(
    fingerprint: Fingerprint, tensor_format: TensorFormat
) -> None:
    grant = _grant(fingerprint)
    reply = acquire_response_pb(grant, tensor_views_pb(grant.tensors, tensor_format))
    if tensor_format == "table":
        reply.tensor_table.nbytes[1] = 10  # F32 (5,) is 20 bytes
    else:
        reply.tensors[1].nbytes = 10

    with pytest.raises(HandleError) as caught:
        build_views(torch.zeros(grant.storage.size, dtype=torch.uint8), view_columns_from_pb(reply))

    assert caught.value.reason == "INVALID_HANDLE"
    assert str(caught.value) == (
        "tensor 'b': nbytes 10 is not its shape (5,) times the 4-byte size of F32"
    )


def test_views_without_nbytes_from_an_older_daemon_are_read_as_before(
    fingerprint: Fingerprint,
) -> None:
    grant = _grant(fingerprint)
    table = acquire_response_pb(grant, tensor_views_pb(grant.tensors, "table"))
    table.tensor_table.ClearField("nbytes")
    views = acquire_response_pb(grant)
    for view in views.tensors:
        view.ClearField("nbytes")

    assert grant_from_pb(table) == grant_from_pb(views) == grant
    table.tensor_table.nbytes.append(8)  # one entry, four tensors
    with pytest.raises(HandleError, match="nbytes does not hold one entry per tensor"):
        view_columns_from_pb(table)
