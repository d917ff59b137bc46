"""The compiled view builder (``weightcache._views``, client/csrc/views.cpp) against the
Python one it stands in for.

On CPU, :func:`weightcache._handles.build_views` builds its views with the compiled module
when it is there; one ``torch.as_strided`` per view otherwise. Over generated view tables
(every dtype size, ranks 0 to 3, zero-size dims, zero and overlapping strides, offsets
anywhere from before the arena to past its end, right and wrong ``nbytes``, sizes that
overflow 64 bits), the two must accept the same views, build them with the same dtype,
sizes, strides, offset and storage, and refuse the same ones: whatever the compiled
module refuses, the Python checks (``_checked_views``) refuse too, naming the view.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from weightcache import _handles
from weightcache.core.dtypes import TORCH_DTYPES
from weightcache.core.errors import HandleError
from weightcache.core.records import ViewColumns, ViewRow

ARENA_BYTES = 4096
DTYPES = ["U8", "BF16", "F16", "F32", "I64", "F8_E4M3", "BOOL"]
NATIVE = _handles._NATIVE

needs_native = pytest.mark.skipif(
    NATIVE is None, reason="weightcache._views is not built (make native: needs a C++ compiler)"
)


def _buildable() -> bool:
    include = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which("c++") is not None and include.is_file()


@pytest.mark.skipif(not _buildable(), reason="no C++ compiler or no Python.h here to build it")
def test_the_compiled_module_is_built() -> None:
    """`make setup` builds it wherever a C++ compiler is: without it every CPU attach
    builds its views in Python, about three times slower per tensor."""
    assert NATIVE is not None
    assert NATIVE.__name__ == "weightcache._views"


def _item(dtype: str) -> int:
    return TORCH_DTYPES[dtype].itemsize


@st.composite
def _rows(draw: st.DrawFn, valid: bool) -> ViewRow:
    """A view of a ``ARENA_BYTES`` arena: inside it and consistent when ``valid``, else
    anything near its edges."""
    dtype = draw(st.sampled_from(DTYPES))
    item = _item(dtype)
    rank = draw(st.integers(0, 3))
    if valid:
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=rank, max_size=rank)))
        stride = tuple(draw(st.lists(st.integers(0, 8), min_size=rank, max_size=rank)))
        reach = (
            0
            if 0 in shape
            else item * (1 + sum((s - 1) * t for s, t in zip(shape, stride, strict=True)))
        )
        top = (ARENA_BYTES - reach) // item if reach else ARENA_BYTES // item
        offset = item * draw(st.integers(0, max(top, 0)))
        numel = 1
        for size in shape:
            numel *= size
        return ("v", dtype, shape, stride, offset, draw(st.sampled_from([0, numel * item])))
    sizes = st.one_of(st.integers(-2, 8), st.sampled_from([2**31, 2**62, 2**63 - 1]))
    strides = st.one_of(st.integers(-2, 600), st.sampled_from([2**40, 2**62]))
    shape = tuple(draw(st.lists(sizes, min_size=rank, max_size=rank)))
    stride = tuple(draw(st.lists(strides, min_size=rank, max_size=rank)))
    offset = draw(st.one_of(st.integers(-16, ARENA_BYTES + 16), st.sampled_from([2**62])))
    nbytes = draw(st.one_of(st.just(0), st.integers(1, 64), st.sampled_from([2**63 - 1])))
    return ("v", dtype, shape, stride, offset, nbytes)


def _columns(rows: list[ViewRow]) -> ViewColumns:
    named = [(f"t{i}", *row[1:]) for i, row in enumerate(rows)]
    return ViewColumns.of_rows(named)


def _bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.reshape(-1).clone(memory_format=torch.contiguous_format)
    return bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def _described(tensor: torch.Tensor) -> tuple[object, ...]:
    return (
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.untyped_storage().data_ptr(),
    )


@needs_native
@settings(max_examples=300, deadline=None)
@given(rows=st.lists(_rows(valid=True), max_size=12))
@example(rows=[("v", "F32", (), (), 0, 0)])  # no shape entry at all
@example(rows=[("v", "F32", (2,), (1,), 0, 8), ("v", "F32", (), (), 8, 4)])  # 0-d last
def test_valid_views_are_built_alike(rows: list[ViewRow]) -> None:
    base = torch.arange(ARENA_BYTES, dtype=torch.int64).to(torch.uint8)
    columns = _columns(rows)

    compiled = _handles._compiled_views(base, columns)
    strided = _handles._bulk_views(base, columns)

    assert compiled is not None and strided is not None
    assert [_described(t) for t in compiled] == [_described(t) for t in strided.values()]
    assert list(_handles.build_views(base, columns)) == columns.names
    for got, want in zip(compiled, strided.values(), strict=True):
        # Bitwise: the same bytes under each view (bool, fp8 and NaN payloads compared as
        # bytes, not values).
        assert _bytes(got) == _bytes(want)


@needs_native
@settings(max_examples=600, deadline=None)
@given(rows=st.lists(st.one_of(_rows(valid=True), _rows(valid=False)), min_size=1, max_size=6))
# A negative size or stride after a zero size: the view is empty, and still refused.
@example(rows=[("v", "F32", (0, -1), (1, 1), 0, 0)])
@example(rows=[("v", "F32", (0, 2), (1, -1), 0, 0)])
@example(rows=[("v", "F16", (2**62, 4), (1, 1), 0, 0)])
@example(rows=[("v", "F32", (), (), 4096, 0)])
# Stride 0 over 2**62 elements: one element in memory, more than 2**63 bytes as a length.
@example(rows=[("v", "BF16", (2**62,), (0,), 0, 0)])
@example(rows=[("v", "BF16", (2**62,), (0,), 0, 8)])
@example(rows=[("v", "BF16", (2**62, 4), (0, 0), 0, 0)])
# Empty, with sizes whose product passes 2**63 - 1 (torch: refused once it passes 2**64,
# even before the 0).
@example(rows=[("v", "U8", (2, 2**62, 0), (0, 0, 0), 0, 0)])
@example(rows=[("v", "U8", (2**62, 8, 0), (1, 1, 1), 0, 0)])
def test_the_compiled_module_refuses_what_the_python_checks_refuse(rows: list[ViewRow]) -> None:
    base = torch.zeros(ARENA_BYTES, dtype=torch.uint8)
    columns = _columns(rows)
    try:
        python = _handles._checked_views(base, columns.rows())
    except HandleError:
        python = None
    try:
        compiled = _handles._compiled_views(base, columns)
    except ValueError:
        compiled = None
    event("refused" if python is None else "accepted")

    assert (compiled is None) == (python is None)
    if compiled is not None and python is not None:
        assert [_described(t) for t in compiled] == [_described(t) for t in python.values()]


@needs_native
def test_a_refused_view_is_named_by_the_python_checks() -> None:
    """The compiled module only says which row; build_views then names the tensor."""
    base = torch.zeros(ARENA_BYTES, dtype=torch.uint8)
    columns = _columns(
        [("v", "F32", (4,), (1,), 0, 16), ("v", "F32", (4,), (1,), ARENA_BYTES - 8, 16)]
    )

    with pytest.raises(ValueError, match="view 1: reaches past the arena"):
        _handles._compiled_views(base, columns)
    with pytest.raises(HandleError, match="tensor 't1': reaches past the 4096-byte arena"):
        _handles.build_views(base, columns)


@needs_native
def test_an_arena_that_is_not_its_whole_storage_is_left_to_torch() -> None:
    """The compiled checks bound views by ``size``, which must be the storage's: a base
    cut from a larger storage is refused there, and built one as_strided at a time."""
    storage = torch.zeros(2 * ARENA_BYTES, dtype=torch.uint8)
    base = storage[:ARENA_BYTES]
    columns = _columns([("v", "U8", (8,), (1,), 0, 8)])

    with pytest.raises(ValueError, match="not of the given size"):
        _handles._compiled_views(base, columns)
    assert tuple(_handles.build_views(base, columns)["t0"].shape) == (8,)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "as_strided"])
@pytest.mark.parametrize(
    ("shape", "stride"), [((0, -1), (1, 1)), ((0, 2), (1, -1))], ids=["size", "stride"]
)
def test_a_negative_size_or_stride_beside_a_zero_size_is_refused(
    monkeypatch: pytest.MonkeyPatch, compiled: bool, shape: tuple[int, ...], stride: tuple[int, ...]
) -> None:
    """``torch.as_strided`` builds such a view (it has no element); both paths refuse it."""
    if compiled and NATIVE is None:
        pytest.skip("weightcache._views is not built")
    if not compiled:
        monkeypatch.setattr(_handles, "_NATIVE", None)
    columns = _columns([("v", "F32", shape, stride, 0, 0)])

    with pytest.raises(HandleError) as caught:
        _handles.build_views(torch.zeros(ARENA_BYTES, dtype=torch.uint8), columns)

    assert caught.value.reason == "INVALID_HANDLE"
    assert str(caught.value).endswith(f"tensor 't0': shape {shape} and stride {stride} disagree")


@needs_native
def test_ranks_that_wrap_around_are_refused_before_any_read() -> None:
    """sum(ranks) over 64 bits wraps to the length of ``shape``: refused as too many."""
    assert NATIVE is not None
    typed = [torch.zeros(16, dtype=torch.uint8)]
    ranks = [1, 2**63 - 1, 2**63 - 1, 2]

    with pytest.raises(ValueError, match="fewer than sum"):
        NATIVE.views(typed, [0] * 4, ranks, [4], [1], [0] * 4, [0] * 4, 16)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "as_strided"])
def test_a_write_through_a_tied_name_is_seen_by_autograd(
    monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """Two names over the same bytes share the arena's version counter on both paths:
    a backward that saved one of them refuses once the other was written in place."""
    if compiled and NATIVE is None:
        pytest.skip("weightcache._views is not built")
    if not compiled:
        monkeypatch.setattr(_handles, "_NATIVE", None)
    columns = _columns([("v", "F32", (4,), (1,), 0, 16), ("v", "F32", (4,), (1,), 0, 16)])
    weight, tied = _handles.build_views(
        torch.zeros(ARENA_BYTES, dtype=torch.uint8), columns
    ).values()
    x = torch.ones(4, requires_grad=True)
    y = (x * weight).sum()
    with torch.no_grad():
        tied.add_(1)

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.backward(y)
    assert torch.equal(weight, torch.ones(4))
