"""Which GEMM a CPU engine's unquantized linears run on the daemon's tensors (``cpu_gemm``).

On CPU, vLLM's ``process_weights_after_loading`` hands every unquantized 2-D linear weight
(``UnquantizedLinearMethod``, and the LM head's ``UnquantizedEmbeddingMethod``) to
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, which picks a kernel
once per layer (vLLM 0.32):

- oneDNN (``ops.create_onednn_mm``) where oneDNN has a matmul for the dtype on this CPU:
  float32 on AVX2 and up, bfloat16 on AVX-512 BF16 or AMX (not under
  ``ONEDNN_MAX_CPU_ISA=AVX2``). The weight is reordered into a buffer oneDNN allocates and
  owns inside an opaque C++ handle (``MatMulPrimitiveHandler``; Python sees only its
  address in an int64 tensor), and the linear's ``weight`` is replaced by an empty tensor
  (the LM head keeps its weight: the embedding may share it). No API gives the handle a
  buffer of the caller's, so the packed form cannot live in the daemon's shared memory:
  each engine holds a private copy of its linear weights;
- sgl-kernel's ``convert_weight_packed`` (AMX, weights up to 1 MiB) and zentorch (AMD's
  Zen build): private packed copies too;
- else ``torch.nn.functional.linear`` on the weight as loaded: no copy.

``cpu_gemm`` (``model_loader_extra_config``) chooses, on the vLLM-named path only (the
checkpoint-tensor path copies into the engine's own parameters anyway):

- ``"repacked"``: vLLM's choice, as with its default loader (a private packed copy per
  engine where vLLM packs);
- ``"shared"``: every such 2-D weight stays the daemon's tensor and its layer runs vLLM's
  own fallback, ``torch.nn.functional.linear`` (no copy: each engine beyond the first
  adds no weight bytes). Other weights (convolution, MoE experts) are vLLM's choice.

The default, ``"auto"`` (:data:`DEFAULT`), is ``"repacked"``, vLLM's choice, for every
dtype (:func:`resolve`): it serves fastest. Measured on a quiet machine
(``bench/vllm_gemm.py --layers 4``, bf16, AMD EPYC with AVX-512 BF16, bench/README.md
issue 38, 2026-12-05, 05:11 and 05:15): one sequence's greedy decode ran at 50.2, then
45.5 (median of 2) tokens/s on oneDNN's packed copies against 26.0, then 30.1 on the
shared weights (the same tokens), so ``"shared"`` is the memory choice: ``load_model``
0.03 s against 0.38 s, and a second engine adds 0.61 GiB of PSS (its process; no weight
bytes) against 1.18 GiB.
(An earlier run on a machine at load average 8 to 40 had both at about 4.8 tokens/s and
made ``"shared"`` the bf16 default; the quiet runs reversed it.) Under
``ONEDNN_MAX_CPU_ISA=AVX2`` vLLM does not pack bf16, so both modes hold the daemon's
tensors there. In float32, ``torch.nn.functional.linear`` and oneDNN's packed GEMM round
differently (MiniLM's embeddings are not bitwise the default loader's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: The values of ``cpu_gemm``.
MODES = ("auto", "shared", "repacked")
#: The default ``cpu_gemm`` (the module docstring gives the measures).
DEFAULT = "auto"
#: The vLLM module whose function picks a CPU linear's kernel; its callers (linear.py,
#: vocab_parallel_embedding.py) import the function from it when processing runs.
_DISPATCH_MODULE = "vllm.model_executor.layers.utils"
_DISPATCH = "dispatch_cpu_unquantized_gemm"


def resolve(mode: str, dtype: torch.dtype) -> str:
    """``mode``, with ``"auto"`` made ``"repacked"`` (vLLM's choice: the faster decode,
    measured in the module docstring) whatever ``dtype`` is.

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
    """
    del dtype  # the measured choice is the same for every dtype
    if mode not in MODES:
        raise ValueError(f"cpu_gemm must be one of {MODES}, not {mode!r}")
    return "repacked" if mode == "auto" else mode


@contextlib.contextmanager
def processing(mode: str, dtype: torch.dtype) -> Iterator[list[str]]:
    """Run ``process_weights_after_loading`` of a ``dtype`` model inside: with ``"shared"``
    (or ``"auto"`` resolved to it, :func:`resolve`), each unquantized
    2-D linear weight processed in the block keeps its tensor (the daemon's, zero-copy)
    and runs ``torch.nn.functional.linear``; with ``"repacked"``, nothing changes.

    vLLM has a per-layer switch for this, ``_cpu_skip_gemm_dispatch`` (MLA's
    ``kv_b_proj``), but only for linears, and other quantization methods read it too; the
    LM head has none. So the dispatch function is replaced for the block, and restored.

    Yields:
        the layers' classes kept shared, one entry per layer (empty for ``"repacked"``).

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
    """
    kept: list[str] = []
    if resolve(mode, dtype) == "repacked":
        yield kept
        return
    import importlib

    import torch

    utils = importlib.import_module(_DISPATCH_MODULE)
    original = getattr(utils, _DISPATCH)

    def plain(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            original(layer, remove_weight)
            return
        # vLLM's own fallback (the end of dispatch_cpu_unquantized_gemm): the weight as
        # loaded, which is the daemon's tensor.
        object.__setattr__(layer, "cpu_linear", torch.nn.functional.linear)
        kept.append(type(layer).__name__)

    setattr(utils, _DISPATCH, plain)
    try:
        yield kept
    finally:
        setattr(utils, _DISPATCH, original)
