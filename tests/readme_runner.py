"""Run one of the README's code blocks as written, in this process, then check it.

The convention (README, "In a worker"): a fenced ``python`` block preceded by the line
``<!-- readme-test: NAME -->`` is a test. :func:`blocks` extracts them; run as
``python tests/readme_runner.py NAME MODEL_DIR OUT``, this executes block ``NAME`` with
``/models/minilm`` replaced by ``MODEL_DIR`` (the daemon, if any, is the one of
``$WEIGHTCACHE_SOCKET``), then ``CHECKS[NAME]`` writes what the test asserts on into the
folder ``OUT``: ``reply.json`` and tensors in ``tensors.safetensors``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parent.parent / "README.md"
#: The model path the README's examples use.
MODEL_PLACEHOLDER = "/models/minilm"
#: The marker line, then the fenced block right after it.
_BLOCK = re.compile(r"^<!-- readme-test: ([\w-]+) -->\n```python\n(.*?)^```$", re.M | re.S)
#: The token ids the README's example embeds ([CLS] hello world [SEP]).
INPUT_IDS = [[101, 7592, 2088, 102]]


def blocks(text: str | None = None) -> dict[str, str]:
    """The README's test blocks, by name, in order.

    Raises:
        ValueError: two blocks share a name.
    """
    found: dict[str, str] = {}
    for match in _BLOCK.finditer(README.read_text() if text is None else text):
        if match[1] in found:
            raise ValueError(f"README: two blocks named {match[1]!r}")
        found[match[1]] = match[2]
    return found


def _check_worker(namespace: dict[str, Any], model_dir: str, out: Path) -> dict[str, Any]:
    """The README's worker example: every tensor off meta, ``hidden`` and the same input
    through ``from_pretrained`` saved for a bitwise comparison."""
    import torch
    import transformers
    from safetensors.torch import save_file

    model = namespace["model"]
    weights = namespace["weights"]
    reference = transformers.BertModel.from_pretrained(model_dir)  # in eval mode
    with torch.inference_mode():
        want = reference(input_ids=torch.tensor(INPUT_IDS)).last_hidden_state
    save_file(
        {"hidden": namespace["hidden"].detach().contiguous(), "reference": want.contiguous()},
        out / "tensors.safetensors",
    )
    tensors = [*model.named_parameters(), *model.named_buffers()]
    reason = weights.fallback_reason
    return {
        "source": weights.source,
        "fallback": reason.code if reason else None,
        "on_meta": [n for n, t in tensors if t.is_meta],
        "devices": sorted({str(t.device) for _, t in tensors}),
        "nan": bool(namespace["hidden"].isnan().any()),
    }


def _check_testing(namespace: dict[str, Any], model_dir: str, out: Path) -> dict[str, Any]:
    """A block of pytest tests: call each ``test_*`` function with a fresh ``tmp_path``,
    as pytest would (their own asserts are the check); returns the names called."""
    called = []
    for name, function in namespace.items():
        if name.startswith("test_") and callable(function):
            tmp_path = out / name
            tmp_path.mkdir()
            function(tmp_path)
            called.append(name)
    return {"called": called}


CHECKS: dict[str, Callable[[dict[str, Any], str, Path], dict[str, Any]]] = {
    "worker": _check_worker,
    "testing": _check_testing,
}


def main(name: str, model_dir: str, out: str) -> None:
    code = blocks()[name].replace(MODEL_PLACEHOLDER, model_dir)
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    exec(compile(code, f"README.md[{name}]", "exec"), namespace)
    reply = CHECKS[name](namespace, model_dir, Path(out))
    (Path(out) / "reply.json").write_text(json.dumps(reply))


if __name__ == "__main__":
    main(*sys.argv[1:4])
