"""The vLLM integration's tests: they need vLLM, which only ``make test-vllm``'s venv
(``.venv-vllm``) has. Elsewhere (``make test``) every one of them is skipped, with the
reason below; where vLLM is installed, none is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.vllm.support import EngineRun, make_tiny_llama, run_engine
from weightcache.testing.llama import minilm_dir

NO_VLLM = "vLLM is not installed in this venv: `make test-vllm` runs these in .venv-vllm"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason=NO_VLLM)
    for item in items:
        if "tests/vllm/" in item.nodeid:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama folder (``tests.vllm.support.make_tiny_llama``)."""
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny-llama")


@pytest.fixture(scope="session")
def minilm_default(tmp_path_factory: pytest.TempPathFactory) -> EngineRun:
    """MiniLM's embeddings from vLLM's default loader: the reference."""
    out = tmp_path_factory.mktemp("minilm-default") / "out.pt"
    return run_engine(minilm_dir(), "embed", "auto", out)


@pytest.fixture(scope="session")
def llama_default(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineRun:
    """The tiny Llama's greedy tokens from vLLM's default loader: the reference."""
    out = tmp_path_factory.mktemp("llama-default") / "out.pt"
    return run_engine(llama, "generate", "auto", out)
