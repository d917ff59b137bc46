"""A model worker for the recipe tests: a separate process driven over pipes.

Same protocol as ``weightcache.testing.worker`` (one JSON command per line on stdin, one JSON reply
per line on the original stdout; fd 1 is pointed at stderr first; EOF closes everything
and exits 0), with recipes given as JSON:
``{"dtype", "tp_plan": {pattern: style}, "tp_plan_file", "plugins": ["name:k=v", ...]}``.

Commands (``key`` names one loaded result):

- ``load {key, path, hub, recipe, kwargs, dump}``: ``weightcache.load(path,
  recipe=Recipe(...), **kwargs)``; ``hub`` = ``{cache_root, repo_id, revision}`` resolves
  the path with ``weightcache.hub_snapshot`` here; ``dump`` saves the tensors it got.
- ``module {key, kind, path, torch_dtype, kwargs, dump}``: build a ``bert`` or ``llama``
  module from the folder's config.json, ``weightcache.load_into`` it, build another from
  ``load_from_disk`` + ``weightcache._module.assign`` with the same dtype, run both on a
  fixed input, save ``{"cache": output, "disk": output}`` to ``dump``; reply with where
  the weights came from, which parameters are one object / share bytes, and the warnings
  each path logged; with ``pretrained``, also run ``transformers``' ``from_pretrained``
  of the folder and save its output as ``"pretrained"``.
- ``close {key}``, ``close_all {}``: ``LoadedWeights.close()``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import torch
from safetensors.torch import save_file

import weightcache
from weightcache._module import assign
from weightcache.testing.logs import capture_sdk_logs
from weightcache.testing.protocol import (
    Handler,
    describe,
    in_shared_memory,
    protocol_out,
    serve_commands,
)

SENTENCE = "A restarted worker gets bitwise the weights it would have read from disk."
LLAMA_INPUT = [[1, 5, 9, 17, 33, 65, 127, 2, 0, 64, 100, 3]]


def make_recipe(spec: dict[str, Any] | None) -> weightcache.Recipe | None:
    if spec is None:
        return None
    plan = None
    if spec.get("tp_plan") is not None:
        plan = weightcache.TPPlan.from_mapping(spec["tp_plan"])
    elif spec.get("tp_plan_file") is not None:
        plan = weightcache.TPPlan.from_json(spec["tp_plan_file"])
    return weightcache.Recipe(
        dtype=spec.get("dtype"),
        tp_plan=plan,
        plugins=tuple(weightcache.PluginStep.parse(p) for p in spec.get("plugins", ())),
    )


def dump(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Save private copies of the tensors (views of one arena share storage)."""
    save_file({name: t.detach().clone().contiguous() for name, t in tensors.items()}, path)


def fallback(weights: weightcache.LoadedWeights) -> dict[str, Any] | None:
    reason = weights.fallback_reason
    if reason is None:
        return None
    return {"code": reason.code, "detail": reason.detail, "components": list(reason.components)}


# -- modules -------------------------------------------------------------------------


def build_module(kind: str, path: str) -> torch.nn.Module:
    """A module from the folder's config.json; BERT on the meta device (every parameter
    comes from the checkpoint), Llama on CPU (its rotary buffer is not in checkpoints)."""
    import transformers

    if kind == "bert":
        with torch.device("meta"):
            model: torch.nn.Module = transformers.BertModel(
                transformers.BertConfig.from_pretrained(path)
            )
    elif kind == "llama":
        torch.manual_seed(1234)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(path))
    else:
        raise ValueError(f"unknown module kind {kind!r}")
    return model.eval()


def from_pretrained(kind: str, path: str) -> torch.nn.Module:
    """The module as ``transformers`` itself loads the folder (the reference)."""
    import transformers

    model_class = transformers.BertModel if kind == "bert" else transformers.LlamaForCausalLM
    model: torch.nn.Module = model_class.from_pretrained(path)
    return model.eval()


def warnings(logs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The warning entries of ``capture_sdk_logs``, as JSON."""
    return [
        {"event": e["event"], "names": e.get("names")} for e in logs if e["log_level"] == "warning"
    ]


def forward(kind: str, path: str, model: torch.nn.Module) -> torch.Tensor:
    import transformers

    with torch.inference_mode():
        if kind == "bert":
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
            batch = tokenizer([SENTENCE], return_tensors="pt")
            output: torch.Tensor = model(**batch).last_hidden_state
        else:
            output = model(input_ids=torch.tensor(LLAMA_INPUT)).logits
    return output


def groups(model: torch.nn.Module, key: Callable[[torch.Tensor], int]) -> list[list[str]]:
    """Names of parameters that share ``key`` (object id, data pointer), in groups of 2+."""
    found: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        found.setdefault(key(param), []).append(name)
    return sorted(names for names in found.values() if len(names) > 1)


class WorkerState:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.weights: dict[str, weightcache.LoadedWeights] = {}
        self.modules: dict[str, torch.nn.Module] = {}

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def load(self, cmd: dict[str, Any]) -> dict[str, Any]:
        path = cmd["path"]
        if cmd.get("hub"):
            path = str(weightcache.hub_snapshot(**cmd["hub"]))
        recipe = make_recipe(cmd.get("recipe"))
        try:
            weights = weightcache.load(path, recipe=recipe, **cmd["kwargs"])
        except weightcache.WeightCacheError as err:
            return {"ok": False, "error": describe(err)}
        self.weights[cmd["key"]] = weights
        tensors = weights.tensors
        if cmd.get("dump"):
            dump(tensors, cmd["dump"])
        return {
            "ok": True,
            "path": path,
            "source": weights.source,
            "model": weights.model,
            "fallback_reason": fallback(weights),
            "names": list(tensors),
            "metadata": weights.metadata,
            "fingerprint": {
                "digest": weights.fingerprint.digest,
                "level": weights.fingerprint.level,
                "components": weights.fingerprint.components,
            },
            "in_shared_memory": in_shared_memory(list(tensors.values())),
            "data_ptrs": {n: t.data_ptr() for n, t in tensors.items()},
        }

    def module(self, cmd: dict[str, Any]) -> dict[str, Any]:
        kind, path, key = cmd["kind"], cmd["path"], cmd["key"]
        dtype = getattr(torch, cmd["torch_dtype"]) if cmd.get("torch_dtype") else None
        cached = build_module(kind, path)
        with capture_sdk_logs() as cache_logs:
            weights = weightcache.load_into(cached, path, dtype=dtype, **cmd["kwargs"])
        self.weights[key] = weights
        self.modules[key] = cached
        from_disk = build_module(kind, path)
        with capture_sdk_logs() as disk_logs:
            assign(from_disk, weightcache.load_from_disk(path, dtype=dtype).tensors)
        outputs = {
            "cache": forward(kind, path, cached).contiguous(),
            "disk": forward(kind, path, from_disk).contiguous(),
        }
        if cmd.get("pretrained"):
            outputs["pretrained"] = forward(kind, path, from_pretrained(kind, path)).contiguous()
        save_file(outputs, cmd["dump"])
        params = [p for _, p in cached.named_parameters()]
        return {
            "ok": True,
            "source": weights.source,
            "model": weights.model,
            "fallback_reason": fallback(weights),
            "tensors": len(weights.tensors),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "params_in_shared_memory": in_shared_memory(params),
            "tied_by_id": groups(cached, id),
            "tied_by_data_ptr": groups(cached, lambda p: p.data_ptr()),
            "disk_tied_by_id": groups(from_disk, id),
            "requires_grad": sorted({p.requires_grad for p in params}),
            "warnings": warnings(cache_logs),
            "disk_warnings": warnings(disk_logs),
        }

    def close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.weights.pop(cmd["key"]).close()
        return {"ok": True}

    def close_all(self, cmd: dict[str, Any] | None = None) -> dict[str, Any]:
        for weights in self.weights.values():
            weights.close()
        self.weights.clear()
        self.modules.clear()
        return {"ok": True}


def main() -> None:
    state = WorkerState(protocol_out())
    handlers: dict[str, Handler] = {
        "load": state.load,
        "module": state.module,
        "close": state.close,
        "close_all": state.close_all,
    }
    serve_commands(sys.stdin, handlers, state.send)
    state.close_all()


if __name__ == "__main__":
    main()
