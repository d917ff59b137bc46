"""``load_into()``: put loaded tensors into a ``torch.nn.Module`` without copying."""

from __future__ import annotations

import os
from typing import Unpack

import torch
from torch import nn

from weightcache._loader import LoadedWeights, load
from weightcache._log import get_logger
from weightcache._missing import compute_missing, install
from weightcache._options import LoadKeywords, LoadOptions

log = get_logger("weightcache")


def load_into(
    module: nn.Module,
    model_dir: str | os.PathLike[str],
    *,
    strict: bool = True,
    options: LoadOptions | None = None,
    **keywords: Unpack[LoadKeywords],
) -> LoadedWeights:
    """Load a checkpoint with :func:`load` and make its tensors the module's parameters.

    Parameters and buffers are *replaced* by the loaded tensors (no copy: with the daemon
    they are views of its arena). Parameters the module ties (one ``nn.Parameter`` reached
    by two names, e.g. input embeddings and LM head) stay one object when the checkpoint
    holds one tensor for them, or bitwise equal tensors: that tensor is used for all the
    names. When it holds differing tensors for them (a config saying
    ``tie_word_embeddings`` over a checkpoint with its own ``lm_head.weight``), they are
    untied: each name gets its own tensor, and a warning log names them. That is what
    ``transformers``' ``from_pretrained`` does (``PreTrainedModel.tie_weights``, which
    compares with ``torch.equal``; here bytes are compared, so ``-0.0`` and ``0.0`` differ).
    Parameters get ``requires_grad=False``. Keep the returned object (and call ``close()``
    when done): it holds the lease.

    No tensor is left on the ``meta`` device: a buffer the checkpoint lacks that is on
    ``meta`` (non-persistent buffers such as BERT's ``position_ids``/``token_type_ids``,
    rotary ``inv_freq``) is computed on the loaded tensors' device by the module's own
    code, as ``from_pretrained`` does (``weightcache._missing``: the nearest
    ``transformers.PreTrainedModel``'s ``_init_weights``, else the owning module's
    ``reset_parameters()``); what is not computed raises :class:`MissingTensorError`.
    Tensors not on ``meta`` that the checkpoint lacks keep their values.

    Args:
        module: the model; it may live on the ``meta`` device.
        model_dir: checkpoint folder.
        strict: raise when a parameter has no tensor or a tensor matches no parameter or
            buffer. Without it, a parameter the checkpoint lacks keeps its value, unless
            it is on ``meta`` (:class:`MissingTensorError`).
        options: the options of :func:`load` (:class:`LoadOptions`).
        **keywords: the same options as keywords (``socket``, ``device``, ``dtype``,
            ``mode``, ...), instead of ``options``; both is a ``TypeError``.

    Raises:
        MissingTensorError: a tensor on ``meta`` that the checkpoint lacks and the
            module's code does not compute (a parameter, always); ``names`` lists them.
            Checked first; a ``ValueError`` too.
        ValueError: ``strict`` and names do not match, or a tensor's shape differs from
            the parameter it replaces. Nothing in the module is changed then.
        Every exception of :func:`load`.
    """
    loaded = load(model_dir, options=options, **keywords)
    try:
        for value in assign(module, loaded.tensors, strict=strict):
            loaded.track(value)
    except ValueError:
        loaded.close()
        raise
    return loaded


def assign(
    module: nn.Module, tensors: dict[str, torch.Tensor], *, strict: bool = True
) -> list[torch.Tensor]:
    """Replace ``module``'s parameters and buffers by ``tensors`` and compute the meta
    buffers they lack (see :func:`load_into`); returns the parameter and buffer objects
    taken from ``tensors`` now in the module.

    Raises:
        MissingTensorError, ValueError: as in :func:`load_into`; the module is left
            unchanged.
    """
    groups = _alias_groups(module)
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    fills = compute_missing(module, groups, tensors.keys(), device)
    plan: list[tuple[list[str], torch.Tensor, bool]] = []
    missing: list[str] = []
    used: set[str] = set()
    for names, current, is_param in groups:
        present = [n for n in names if n in tensors]
        if not present:
            if is_param:
                missing.append(names[0])
            continue
        for source in present:
            tensor = tensors[source]
            if tuple(tensor.shape) != tuple(current.shape):
                raise ValueError(
                    f"{source}: checkpoint shape {tuple(tensor.shape)} != module shape "
                    f"{tuple(current.shape)}"
                )
        used.update(present)
        plan.extend((part, tensors[part[0]], is_param) for part in _untie(names, tensors))
    unexpected = sorted(set(tensors) - used)
    if strict and (missing or unexpected):
        raise ValueError(
            f"checkpoint does not match the module: missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}"
        )
    values = []
    for names, tensor, is_param in plan:
        value: torch.Tensor = nn.Parameter(tensor, requires_grad=False) if is_param else tensor
        values.append(value)
        for name in names:
            owner, attr = _owner(module, name)
            if is_param:
                owner._parameters[attr] = value  # type: ignore[assignment]
            else:
                owner._buffers[attr] = value
    install(fills)
    return values


def _untie(names: list[str], tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Split tied ``names`` into groups whose checkpoint tensors are bitwise equal; names the
    checkpoint lacks join the first group. One group unless the checkpoint disagrees."""
    parts: list[list[str]] = []
    for name in (n for n in names if n in tensors):
        same = next((p for p in parts if _bitwise_equal(tensors[p[0]], tensors[name])), None)
        if same is None:
            parts.append([name])
        else:
            same.append(name)
    parts[0].extend(n for n in names if n not in tensors)
    if len(parts) > 1:
        log.warning(
            "untied: the module ties these parameters but the checkpoint holds different "
            "tensors for them; each gets its own, as transformers' from_pretrained does "
            "(set tie_word_embeddings=False in the config to silence this)",
            names=[n for n in names if n in tensors],
        )
    return parts


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True  # one tensor stored once and reached by both names
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _alias_groups(module: nn.Module) -> list[tuple[list[str], torch.Tensor, bool]]:
    """Names of each distinct parameter (then buffer), tied names grouped together."""
    groups: dict[int, tuple[list[str], torch.Tensor, bool]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), ([], param, True))[0].append(name)
    for name, buf in module.named_buffers(remove_duplicate=False):
        groups.setdefault(id(buf), ([], buf, False))[0].append(name)
    return list(groups.values())


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr
