"""Demo worker: build all-MiniLM-L6-v2 without weights, get them, embed a few sentences.

Run by ``demo.py``, once per weight source::

    python demo/worker.py MODEL_DIR --source cache --socket PATH --out FILE --launched-at T

``--source cache`` attaches with ``weightcache.load_into`` (zero-copy from the daemon);
``--source disk`` reads the checkpoint with ``weightcache.load_from_disk``. The model is
built on the ``meta`` device, so construction allocates and initialises nothing; the
loaded tensors become its parameters and buffers. ``--out`` receives a ``torch.save``
dict: embeddings, sentences, source, fallback reason and timings in seconds
(``load_s``: the load call; ``before_s``: launch to just before it; ``launch_s``: launch
to its return).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import time

import torch
import transformers
from torch.nn import functional

import weightcache
from weightcache._module import assign

SENTENCES = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "A cheetah is running behind its prey.",
    "Shared memory lets a restarted worker skip reading its weights from disk.",
)


def build_model(model_dir: str) -> transformers.BertModel:
    """A ``BertModel`` from the folder's config.json, on the meta device, in eval mode."""
    config = transformers.BertConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.BertModel(config)
    model.eval()  # type: ignore[no-untyped-call]  # transformers leaves eval() unannotated
    return model


def get_weights(
    model: torch.nn.Module, model_dir: str, source: str, socket: str
) -> tuple[weightcache.LoadedWeights, float]:
    """Put the checkpoint's tensors into ``model``.

    Returns:
        The loaded weights (hold them: they carry the lease) and the seconds the call took.
    """
    start = time.perf_counter()
    if source == "cache":
        weights = weightcache.load_into(model, model_dir, socket=socket)
    else:
        weights = weightcache.load_from_disk(model_dir)
        assign(model, weights.tensors)
    return weights, time.perf_counter() - start


def materialise_buffers(model: transformers.BertModel) -> None:
    """Create the one buffer the checkpoint lacks, then check nothing is left on meta.

    ``embeddings.token_type_ids`` is a non-persistent buffer of zeros shaped like
    ``position_ids`` (which the checkpoint does hold).

    Raises:
        RuntimeError: a parameter or buffer is still on the meta device.
    """
    embeddings = model.embeddings
    # A plain attribute set, as transformers itself does: the buffer is not persistent.
    embeddings.token_type_ids = torch.zeros_like(embeddings.position_ids)  # type: ignore[assignment]
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device after loading: {left}")


def embed(model: torch.nn.Module, model_dir: str, sentences: tuple[str, ...]) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them for this model.

    Mean of the token states over the attention mask, then L2-normalised.

    Returns:
        A float32 tensor of shape (len(sentences), hidden size).
    """
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(list(sentences), padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    return functional.normalize(pooled, p=2, dim=1)


def main() -> None:
    """Parse the arguments, load, embed, and save the result to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--source", choices=("cache", "disk"), required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--launched-at", type=float, required=True, help="parent's time.time()")
    args = parser.parse_args()

    model = build_model(args.model_dir)
    before_s = time.time() - args.launched_at
    weights, load_s = get_weights(model, args.model_dir, args.source, args.socket)
    launch_s = time.time() - args.launched_at
    materialise_buffers(model)
    embeddings = embed(model, args.model_dir, SENTENCES)
    reason = weights.fallback_reason
    torch.save(
        {
            "embeddings": embeddings,
            "sentences": list(SENTENCES),
            "source": weights.source,
            "fallback": f"{reason.code}: {reason.detail}" if reason else "",
            "tensors": len(weights.tensors),
            "load_s": load_s,
            "launch_s": launch_s,
            "before_s": before_s,
        },
        args.out,
    )
    weights.close()


if __name__ == "__main__":
    main()
