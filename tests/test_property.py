"""Properties over generated checkpoints and recipes.

A generated case: 1-6 tensors with random names, every dtype the issue names (BF16, F16,
F32, F8_E4M3, F8_E5M2, BOOL, U8, I8, I16, I32, I64), shapes with zero-size dims and 0-d,
random bytes (NaN payloads and all), in 1-3 shard files (with an index, or one
``model.safetensors``); a recipe with or without a dtype cast, ``tp_size`` 1 or 2 and a
plan of colwise / rowwise / replicate rules (transformers' alias names too) over exact
names, module names and globs, given as a ``TPPlan`` or as a plan file.

- On disk, in this process (many examples): every rank's tensors are the stored ones split
  as planned and then cast (integer, bool and fp8 never), the uncast ranks concatenate
  back to the stored tensors (colwise along dim 0, rowwise along dim 1, replicated
  equal), and the fingerprint of another rank or dtype differs in exactly ``placement``
  or ``recipe``.
- Through one daemon (remote Preload of each rank) and one worker process (fewer
  examples): every rank's attached tensors equal, bitwise and by name, what
  ``load_from_disk`` gives with the same recipe.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import weightcache
from tests.recipe_support import (
    TEST_TIMEOUT,
    RecipeWorker,
    RecipeWorkerPool,
    children_env,
    evict,
    list_models,
    preload,
    recipe_json,
    start_daemons,
    wait_ready,
    write_shards,
)
from tests.support import SINGLE_FILE, Daemon, DaemonPool, assert_attached, assert_bitwise_equal
from weightcache.core.dtypes import CASTABLE, TORCH_DTYPES
from weightcache.v1 import weight_cache_service_pb2 as pb

pytestmark = pytest.mark.timeout(TEST_TIMEOUT)

DTYPES = ("BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "BOOL", "U8", "I8", "I16", "I32", "I64")
ALIASES = {
    "colwise": ("colwise", "colwise_rep", "local_colwise", "colwise_gather_output"),
    "rowwise": ("rowwise", "rowwise_rep", "local_rowwise", "rowwise_split_input"),
    "replicate": ("replicate", "local", "sequence_parallel"),
}
#: Hypothesis settings: bounded, no deadline (a loaded machine), no example database.
DISK = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
DAEMON = settings(
    max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@dataclass(frozen=True)
class GenTensor:
    """One generated tensor.

    Attributes:
        name: its name; the first dot-separated segment starts with a capital letter, is
            unique in the case and appears nowhere else, so each rule matches one tensor.
        dtype: safetensors dtype name.
        shape: sizes, possibly empty (0-d) or with zeros.
        style: the style of the rule written for it, or None (no rule).
        pattern: that rule's pattern: the name, the module name or a glob.
        split: the dim the rule splits (None: the tensor is replicated).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    style: str | None
    pattern: str | None
    split: int | None


@dataclass(frozen=True)
class Case:
    """A generated checkpoint and recipe.

    Attributes:
        tensors: the tensors, in generation order.
        shard_of: tensor name -> shard file name.
        indexed: whether there is a ``model.safetensors.index.json``.
        seed: of the tensors' random bytes.
        dtype: the recipe's cast, or None.
        tp_size: 1 or 2.
        rules: the plan, in order, as written (styles may be transformers aliases).
        plan_file: give the plan as a file (``TPPlan.from_json``) rather than a mapping;
            ``wrapped``: the file is ``{"tp_plan": {...}}``.
    """

    tensors: tuple[GenTensor, ...]
    shard_of: dict[str, str]
    indexed: bool
    seed: int
    dtype: str | None
    tp_size: int
    rules: tuple[tuple[str, str], ...]
    plan_file: bool
    wrapped: bool

    def values(self) -> dict[str, torch.Tensor]:
        """The stored tensors (random bytes; valid booleans)."""
        gen = torch.Generator().manual_seed(self.seed)
        out = {}
        for t in self.tensors:
            dtype = TORCH_DTYPES[t.dtype]
            if dtype == torch.bool:
                out[t.name] = torch.rand(t.shape, generator=gen) > 0.5
                continue
            count = torch.Size(t.shape).numel() * dtype.itemsize
            raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen)
            out[t.name] = raw.view(dtype).reshape(t.shape)
        return out

    def write(self, folder: Path) -> dict[str, torch.Tensor]:
        """Write the checkpoint (and the plan file) to ``folder``; returns the tensors."""
        values = self.values()
        shards: dict[str, dict[str, torch.Tensor]] = {}
        for name, file in self.shard_of.items():
            shards.setdefault(file, {})[name] = values[name]
        write_shards(folder, shards, index=self.indexed)
        if self.plan_file:
            plan = dict(self.rules)
            (folder / "plan.json").write_text(
                json.dumps({"tp_plan": plan} if self.wrapped else plan)
            )
        return values

    def recipe(self, folder: Path, *, cast: bool = True) -> weightcache.Recipe:
        """The recipe, as the worker builds it from :meth:`recipe_spec`."""
        plan = (
            weightcache.TPPlan.from_json(folder / "plan.json")
            if self.plan_file
            else weightcache.TPPlan.from_mapping(dict(self.rules))
        )
        return weightcache.Recipe(dtype=self.dtype if cast else None, tp_plan=plan)

    def recipe_spec(self, folder: Path) -> dict[str, object]:
        if self.plan_file:
            return recipe_json(dtype=self.dtype, tp_plan_file=folder / "plan.json")
        return recipe_json(dtype=self.dtype, tp_plan=dict(self.rules))

    def canonical_rules(self) -> list[tuple[str, str]]:
        """The rules with transformers' alias styles resolved (what a Preload carries)."""
        canonical = {alias: style for style, names in ALIASES.items() for alias in names}
        return [(pattern, canonical[style]) for pattern, style in self.rules]


@st.composite
def gen_tensor(draw: st.DrawFn, first: str, tp_size: int) -> GenTensor:
    middles = draw(st.lists(st.from_regex(r"[a-z0-9_\u00e9]{1,5}", fullmatch=True), max_size=2))
    leaf = draw(
        st.sampled_from(["weight", "bias", "scale"])
        | st.from_regex(r"[a-z0-9_]{1,5}", fullmatch=True)
    )
    dotted = draw(st.integers(0, 4)) > 0
    name = ".".join([first, *middles, leaf]) if dotted else first
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.sampled_from([0, 1, 2, 2, 2, 3]))  # mostly matrices, which both styles split
    shape = list(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    style = draw(st.sampled_from([None, "colwise", "rowwise", "rowwise", "replicate"]))
    split = None
    if style == "colwise" and shape:
        split = 0
    elif style == "rowwise" and len(shape) == 2:
        split = 1
    if split is not None and shape[split] % tp_size:
        shape[split] += 1  # divisible, so that the split is valid
    pattern = None
    if style is not None:
        kinds = ["name", "module", "glob"] if dotted else ["name"]
        kind = draw(st.sampled_from(kinds))
        module = name.rpartition(".")[0]
        pattern = {"name": name, "module": module, "glob": f"{first}.*"}[kind]
    return GenTensor(name, dtype, tuple(shape), style, pattern, split)


@st.composite
def cases(draw: st.DrawFn, max_tensors: int = 6) -> Case:
    tp_size = draw(st.sampled_from([1, 2, 2]))
    count = draw(st.integers(1, max_tensors))
    firsts = draw(
        st.lists(
            st.from_regex(r"[A-Z][a-z0-9_]{0,4}", fullmatch=True),
            min_size=count,
            max_size=count,
            unique=True,
        )
    )
    tensors = tuple(draw(gen_tensor(first, tp_size)) for first in firsts)
    nshards = draw(st.integers(1, min(3, count)))
    indexed = nshards > 1 or draw(st.booleans())
    if indexed:
        files = draw(
            st.lists(
                st.from_regex(r"[a-z0-9_-]{1,8}", fullmatch=True),
                min_size=nshards,
                max_size=nshards,
                unique=True,
            )
        )
        files = [f"{f}.safetensors" for f in files]
    else:
        files = [SINGLE_FILE]
    order = draw(st.permutations(range(count)))
    shard_of = {}
    for i, tensor in enumerate(tensors):
        # The first nshards tensors (in a random order) give every shard one tensor.
        slot = order.index(i)
        shard = slot if slot < nshards else draw(st.integers(0, nshards - 1))
        shard_of[tensor.name] = files[shard]
    use_aliases = draw(st.booleans())
    rules = []
    for tensor in tensors:
        if tensor.style is None or tensor.pattern is None:
            continue
        style = draw(st.sampled_from(ALIASES[tensor.style])) if use_aliases else tensor.style
        rules.append((tensor.pattern, style))
    rules = list(draw(st.permutations(rules)))
    if not rules or draw(st.booleans()):
        # A catch-all last changes nothing. (A plan needs a rule: an empty list of rules in
        # a Preload means "the transformers plan", which these checkpoints lack.)
        rules.append(("*", "replicate"))
    return Case(
        tensors=tensors,
        shard_of=shard_of,
        indexed=indexed,
        seed=draw(st.integers(0, 2**32 - 1)),
        dtype=draw(st.sampled_from([None, "BF16", "F16", "F32", "F64"])),
        tp_size=tp_size,
        rules=tuple(rules),
        plan_file=draw(st.booleans()),
        wrapped=draw(st.booleans()),
    )


def expected_piece(
    stored: torch.Tensor, tensor: GenTensor, rank: int, tp_size: int, dtype: str | None
) -> torch.Tensor:
    """What rank ``rank`` holds of a stored tensor: the same operations, in the same order,
    as the recipe documents (split, then cast floating tensors), so that even NaN payloads
    (which torch converts differently on its vectorized and scalar paths) agree."""
    piece = stored
    if tp_size > 1 and tensor.split is not None:
        part = stored.shape[tensor.split] // tp_size
        piece = stored.narrow(tensor.split, rank * part, part)
    if dtype is not None and tensor.dtype in CASTABLE and tensor.dtype != dtype:
        piece = piece.to(TORCH_DTYPES[dtype])
    return piece


def check_ranks(
    case: Case,
    stored: dict[str, torch.Tensor],
    ranks: list[dict[str, torch.Tensor]],
    dtype: str | None,
) -> None:
    """Each rank holds the planned piece of every tensor, with the cast semantics; the
    uncast ranks concatenate back to the stored tensors."""
    for tensor in case.tensors:
        pieces = [r[tensor.name] for r in ranks]
        for rank, piece in enumerate(pieces):
            want = expected_piece(stored[tensor.name], tensor, rank, case.tp_size, dtype)
            assert_bitwise_equal({tensor.name: piece}, {tensor.name: want})
        if dtype is not None and tensor.dtype in CASTABLE and tensor.dtype != dtype:
            assert {p.dtype for p in pieces} == {TORCH_DTYPES[dtype]}
            continue
        assert {p.dtype for p in pieces} == {TORCH_DTYPES[tensor.dtype]}
        whole = stored[tensor.name]
        if case.tp_size > 1 and tensor.split is not None:
            joined = torch.cat(pieces, tensor.split)
            assert_bitwise_equal({tensor.name: joined}, {tensor.name: whole})
        else:
            for piece in pieces:
                assert_bitwise_equal({tensor.name: piece}, {tensor.name: whole})


def _events(case: Case) -> None:
    """Label the example (``--hypothesis-show-statistics`` shows the mix)."""
    event(f"tp_size={case.tp_size}")
    event(f"dtype={case.dtype}")
    event(f"shards={len(set(case.shard_of.values()))}, index={case.indexed}")
    for tensor in case.tensors:
        if case.tp_size > 1 and tensor.split is not None:
            event(f"split dim {tensor.split}")


# -- on disk, in this process ---------------------------------------------------------


@DISK
@given(case=cases())
def test_disk_ranks_are_the_planned_pieces_cast_as_documented(case: Case) -> None:
    _events(case)
    with tempfile.TemporaryDirectory(prefix="wcprop") as tmp:
        folder = Path(tmp) / "ckpt"
        stored = case.write(folder)
        checkpoint = weightcache.open_checkpoint(folder)
        assert sorted(s.name for s in checkpoint.shards) == sorted(set(case.shard_of.values()))
        order = list(checkpoint.tensors)
        assert sorted(order) == sorted(stored)
        cast, plain, prints = [], [], []
        for rank in range(case.tp_size):
            got = weightcache.load_from_disk(
                folder, recipe=case.recipe(folder), tp_rank=rank, tp_size=case.tp_size
            )
            uncast = weightcache.load_from_disk(
                folder, recipe=case.recipe(folder, cast=False), tp_rank=rank, tp_size=case.tp_size
            )
            assert list(got.tensors) == list(uncast.tensors) == order
            cast.append(got.tensors)
            plain.append(uncast.tensors)
            prints.append(got.fingerprint)
            if case.dtype is not None:
                assert got.fingerprint.differing(uncast.fingerprint) == ["recipe"]
        if case.tp_size > 1:
            assert prints[1].differing(prints[0]) == ["placement"]
        check_ranks(case, stored, plain, None)
        check_ranks(case, stored, cast, case.dtype)


def test_indivisible_split_is_a_recipe_error(tmp_path: Path) -> None:
    folder = write_shards(
        tmp_path / "c", {SINGLE_FILE: {"a.b.weight": torch.zeros(3, 4)}}, index=False
    )
    for rule, dim, size in (("colwise", 0, 3), ("rowwise", 1, 4)):
        plan = weightcache.TPPlan.from_mapping({"a.b": rule})
        recipe = weightcache.Recipe(tp_plan=plan)
        tp_size = 3 if size == 4 else 2
        with pytest.raises(weightcache.RecipeError) as raised:
            weightcache.load_from_disk(folder, recipe=recipe, tp_rank=0, tp_size=tp_size)
        assert str(raised.value) == (
            f"tensor 'a.b.weight': dim {dim} of size {size} is not divisible by tp_size {tp_size}"
        )


# -- through a daemon and a worker process ---------------------------------------------


@dataclass(frozen=True)
class Served:
    """A daemon accepting remote Preload under ``root``, and a worker."""

    root: Path
    daemon: Daemon
    worker: RecipeWorker


@pytest.fixture(scope="module")
def served(
    module_daemons: DaemonPool, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("property")
    root = base / "root"
    root.mkdir()
    env = children_env(base / "hash-cache")
    args = ["--allow-remote-preload", "--model-root", str(root)]
    daemons = start_daemons(module_daemons, env, {"d": args})
    workers = RecipeWorkerPool(base, env)
    worker = workers.start()
    try:
        wait_ready(daemons.values())
        yield Served(root, daemons["d"], worker)
    finally:
        workers.close()


_example = itertools.count()


@DAEMON
@given(case=cases(max_tensors=5))
def test_attached_ranks_equal_the_disk_loads(served: Served, case: Case) -> None:
    _events(case)
    socket = served.daemon.socket
    folder = served.root / f"ex{next(_example)}"
    dumps = Path(tempfile.mkdtemp(prefix="wcprop"))
    held: list[str] = []
    try:
        stored = case.write(folder)
        for rank in range(case.tp_size):
            responses = preload(
                socket,
                folder,
                dtype=case.dtype or "",
                tp_rules=case.canonical_rules(),
                tp_rank=rank,
                tp_size=case.tp_size,
            )
            name = folder.name
            if case.tp_size > 1:
                name += f"-tp{rank}of{case.tp_size}"
            if case.dtype:
                name += f"-{case.dtype.lower()}"
            assert (responses[-1].model, responses[-1].state) == (name, pb.MODEL_STATE_READY)
            held.append(name)
        ranks = []
        for rank in range(case.tp_size):
            reply = served.worker.load(
                folder,
                key=f"r{rank}",
                recipe=case.recipe_spec(folder),
                socket=socket,
                tp_rank=rank,
                tp_size=case.tp_size,
                fallback=False,
                dump=dumps / f"r{rank}",
            )
            assert_attached(reply)
            assert reply["model"] == held[rank]
            disk = weightcache.load_from_disk(
                folder, recipe=case.recipe(folder), tp_rank=rank, tp_size=case.tp_size
            )
            assert reply["names"] == list(disk.tensors)
            assert reply["fingerprint"]["digest"] == disk.fingerprint.digest
            got = load_file(dumps / f"r{rank}")
            assert_bitwise_equal(got, disk.tensors)
            ranks.append(got)
        check_ranks(case, stored, ranks, case.dtype)
    finally:
        served.worker.close_all()
        for name in held:
            evict(socket, name)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(dumps, ignore_errors=True)
    assert list_models(socket) == []


def _fnmatch_style(rules: tuple[tuple[str, str], ...], name: str) -> str:
    """The decision ``TPPlan.style_for`` made with ``fnmatch.fnmatchcase`` before issue 9."""
    module = name.rpartition(".")[0]
    for pattern, style in rules:
        if (
            fnmatch.fnmatchcase(name, pattern)
            or fnmatch.fnmatchcase(module, pattern)
            or fnmatch.fnmatchcase(module, "*." + pattern)
        ):
            return style
    return "replicate"


_CANONICAL = {alias: style for style, aliases in ALIASES.items() for alias in aliases}
_GLOB = st.text(alphabet="ab.*?[]!-", max_size=10)
_NAME = st.text(alphabet="ab.[]*-", max_size=12)


@DISK
@given(
    rules=st.lists(st.tuples(_GLOB, st.sampled_from(sorted(ALIASES))), min_size=1, max_size=6),
    names=st.lists(_NAME, min_size=1, max_size=8),
    case=cases(),
)
def test_compiled_plan_decides_as_fnmatch(
    rules: list[tuple[str, str]], names: list[str], case: Case
) -> None:
    # Issue 9 item 7: each plan is compiled once, without fnmatch's process-wide cache, and
    # must still decide exactly as fnmatch.fnmatchcase did (random globs, and the plans and
    # tensor names of the cases above).
    for plan_rules, plan_names in (
        (tuple(rules), names),
        (tuple((p, _CANONICAL[s]) for p, s in case.rules), [t.name for t in case.tensors]),
    ):
        plan = weightcache.TPPlan(plan_rules)
        # fnmatch's private cache is not in typeshed; the test looks at it on purpose.
        cache = fnmatch._compile_pattern  # type: ignore[attr-defined]
        cached = cache.cache_info().currsize
        decided = [plan.style_for(name) for name in plan_names]
        assert cache.cache_info().currsize == cached
        assert decided == [_fnmatch_style(plan_rules, name) for name in plan_names]
