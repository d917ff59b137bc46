"""The ``vllm`` recipe: the daemon holds a model as vLLM's model holds it, and an engine
builds its model on the meta device and runs on the daemon's tensors, zero-copy.

A real daemon runs the export (``weightcache.integrations.vllm.export``, vLLM itself, in a
process of its own) at preload; each engine runs in a process of its own. Outputs must be
bitwise those of vLLM's default loader, and every tensor the engine's processing left in
place must lie in the daemon's segment.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import weightcache
from tests.vllm.support import (
    ENGINE_TIMEOUT,
    EngineRun,
    bin_only_copy,
    installed,
    run_engine,
    shadow_vllm_version,
    shared_linears,
    skipped_reasons,
)
from weightcache.core.errors import FingerprintMismatchError, RecipeError
from weightcache.core.plugins import PluginStep
from weightcache.core.recipe import Placement, Recipe
from weightcache.testing import Daemon, DaemonPool
from weightcache.testing.daemon import child_env, list_models
from weightcache.testing.llama import minilm_dir
from weightcache.testing.vllm_engine import MAX_TOKENS, MEMORY_UTILIZATION, PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

WEIGHTCACHE = "weightcache"
#: The export runs vLLM at preload: its imports alone take tens of seconds on a busy CPU.
EXPORT_READY = 900.0
#: The flag that makes a daemon hold models as vLLM's float32 engines hold them.
VLLM_FLOAT32 = ["--recipe", "vllm:dtype=float32"]


def vllm_recipe(dtype: str) -> Recipe:
    """The recipe an engine of ``dtype`` asks for (``loader.engine_recipe``)."""
    return Recipe(plugins=(PluginStep("vllm", (("dtype", dtype), ("quantization", "none"))),))


@pytest.fixture(scope="module")
def held(module_daemons: DaemonPool, llama: Path) -> Daemon:
    """One daemon holding the tiny Llama and MiniLM through the ``vllm`` recipe."""
    daemon = module_daemons.start([llama, minilm_dir()], args=VLLM_FLOAT32, wait=False)
    daemon.wait_ready(EXPORT_READY, models=2)
    return daemon


def assert_on_the_segment(run: EngineRun, names: list[str]) -> None:
    """Every tensor the engine still has from loading lies in the daemon's segment (what
    processing replaced, such as oneDNN-packed linear weights in float32, is gone from the
    model's tensors), and ``names`` among them."""
    placement: dict[str, Any] = run.result["placement"]
    assert placement["elsewhere"] == [], placement
    assert set(names) <= set(placement["in_segment"]), placement
    assert placement["segment_bytes"] > 0


def test_the_daemon_holds_vllms_fused_tensors(held: Daemon, llama: Path) -> None:
    models = {m.name: m for m in list_models(held.socket)}
    assert [p.name for p in models["tiny-llama"].recipe.plugins] == ["vllm"]
    stored = load_file(llama / "model.safetensors")
    with weightcache.load(llama, socket=held.socket, recipe=vllm_recipe("float32")) as weights:
        tensors = weights.tensors
        assert weights.source == "cache"
        layer = "model.layers.0."
        qkv = [stored[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv"]
        gate_up = [stored[f"{layer}mlp.{p}_proj.weight"] for p in ("gate", "up")]
        assert torch.equal(tensors[f"{layer}self_attn.qkv_proj.weight"], torch.cat(qkv))
        assert torch.equal(tensors[f"{layer}mlp.gate_up_proj.weight"], torch.cat(gate_up))
        # vLLM pads the vocabulary of its LM head (to a multiple of 64) with zeros.
        vocab = stored["lm_head.weight"].shape[0]
        assert torch.equal(tensors["lm_head.weight"][:vocab], stored["lm_head.weight"])
        assert not tensors["lm_head.weight"][vocab:].any()
        assert f"{layer}self_attn.rotary_emb.cos_sin_cache" in tensors
        assert f"{layer}self_attn.q_proj.weight" not in tensors


def test_another_dtypes_model_is_a_mismatch_naming_the_recipe(held: Daemon, llama: Path) -> None:
    with pytest.raises(FingerprintMismatchError) as caught:
        weightcache.load(llama, socket=held.socket, recipe=vllm_recipe("bfloat16"), fallback=False)
    assert caught.value.components == ["recipe"]


def test_llama_generates_the_default_loaders_tokens_on_the_daemons_tensors(
    held: Daemon, llama: Path, llama_default: EngineRun, tmp_path: Path
) -> None:
    run = run_engine(llama, "generate", WEIGHTCACHE, tmp_path / "out.pt", {"socket": held.socket})

    assert installed(run), run.log[-4000:]
    assert skipped_reasons(run) == []
    assert run.result["token_ids"] == llama_default.result["token_ids"]
    assert_on_the_segment(run, ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"])
    # The engine held its lease while it ran; its exit ended it.
    assert {m.name: m.lease_count for m in list_models(held.socket)}["tiny-llama"] == 0


#: The tiny Llama's weights that vLLM's CPU processing hands to its GEMM dispatch (vLLM's
#: names): the linears, the LM head and the input embedding (``UnquantizedEmbeddingMethod``
#: processes both); in float32 each gets an engine-private oneDNN copy, unless
#: ``cpu_gemm: shared`` keeps them.
LINEARS = [
    f"model.layers.{i}.{name}.weight"
    for i in range(2)
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
] + ["lm_head.weight", "model.embed_tokens.weight"]


def test_cpu_gemm_shared_runs_every_linear_on_the_daemons_tensors(
    held: Daemon, llama: Path, llama_default: EngineRun, tmp_path: Path
) -> None:
    extra = {"socket": held.socket, "cpu_gemm": "shared"}
    run = run_engine(llama, "generate", WEIGHTCACHE, tmp_path / "out.pt", extra)

    assert installed(run), run.log[-4000:]
    # No linear was repacked: each weight is still the daemon's tensor, whole.
    assert shared_linears(run) == len(LINEARS)
    assert_on_the_segment(run, LINEARS)
    assert run.result["token_ids"] == llama_default.result["token_ids"]


def test_minilm_embeds_as_the_default_loader_on_the_daemons_tensors(
    held: Daemon, minilm_default: EngineRun, tmp_path: Path
) -> None:
    extra = {"socket": held.socket}
    run = run_engine(minilm_dir(), "embed", WEIGHTCACHE, tmp_path / "out.pt", extra)

    assert installed(run), run.log[-4000:]
    got: torch.Tensor = run.result["embeddings"]
    assert got.shape == (5, 384)
    assert torch.equal(got, minilm_default.result["embeddings"])
    assert_on_the_segment(run, ["model.embeddings.word_embeddings.weight"])


def test_another_vllm_versions_model_is_refused_and_the_engine_loads_from_disk(
    module_daemons: DaemonPool, llama: Path, llama_default: EngineRun, tmp_path: Path
) -> None:
    # "+cpu": vLLM's platform detection reads that distribution's version too.
    shadow = shadow_vllm_version(tmp_path / "shadow", "0.31.0+cpu")
    other = module_daemons.start(
        [llama], args=VLLM_FLOAT32, wait=False, env={"PYTHONPATH": str(shadow)}
    )
    other.wait_ready(EXPORT_READY, models=1)
    with pytest.raises(FingerprintMismatchError) as caught:
        weightcache.load(llama, socket=other.socket, recipe=vllm_recipe("float32"), fallback=False)
    assert caught.value.components == ["recipe"]

    run = run_engine(llama, "generate", WEIGHTCACHE, tmp_path / "out.pt", {"socket": other.socket})
    assert skipped_reasons(run) == ["FINGERPRINT_MISMATCH"], run.log[-4000:]
    assert run.fallback_reasons() == ["FINGERPRINT_MISMATCH"]
    assert not installed(run)
    assert run.result["token_ids"] == llama_default.result["token_ids"]


def test_a_bin_only_checkpoint_falls_back_to_the_default_loader(
    held: Daemon, llama: Path, llama_default: EngineRun, tmp_path: Path
) -> None:
    bins = bin_only_copy(llama, tmp_path / "tiny-llama-bin")
    run = run_engine(bins, "generate", WEIGHTCACHE, tmp_path / "out.pt", {"socket": held.socket})

    assert skipped_reasons(run) == ["INVALID_CHECKPOINT"], run.log[-4000:]
    assert run.fallback_reasons() == ["INVALID_CHECKPOINT"]
    assert run.result["token_ids"] == llama_default.result["token_ids"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture
def server(held: Daemon, llama: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The serve command docs/vllm.md gives, on the held Llama; (base URL, its log)."""
    port = free_port()
    extra = json.dumps({"socket": held.socket})
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(llama)]
    command += ["--load-format", "weightcache", "--model-loader-extra-config", extra]
    command += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128"]
    command += ["--gpu-memory-utilization", str(MEMORY_UTILIZATION)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        child = subprocess.Popen(
            command, env=child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        child.terminate()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        result: dict[str, Any] = json.load(answer)
    return result


def wait_up(base: str, log: Path) -> None:
    deadline = time.monotonic() + ENGINE_TIMEOUT
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(1.0)
    raise AssertionError(f"the server did not come up:\n{log.read_text()[-4000:]}")


def test_the_documented_serve_command_serves_on_the_daemons_tensors(
    server: tuple[str, Path], llama: Path, llama_default: EngineRun
) -> None:
    base, log = server
    wait_up(base, log)
    body = {"model": str(llama), "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS}
    body |= {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    answer = post(f"{base}/v1/completions", body)

    assert answer["choices"][0]["token_ids"] == llama_default.result["token_ids"][0]
    assert "weightcache: installed " in log.read_text()


def test_a_model_plugin_is_the_recipes_only_step(llama: Path) -> None:
    recipe = Recipe(dtype="BF16", plugins=(PluginStep("vllm"),))
    with pytest.raises(RecipeError, match="must be the recipe's only step"):
        recipe.identity(llama, Placement())
