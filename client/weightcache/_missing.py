"""Tensors of a module that a checkpoint lacks: computed by the module's own code, or refused.

A module built on the ``meta`` device has no values at all; a load gives it the
checkpoint's. What the checkpoint does not hold is mostly *computed* state: non-persistent
buffers (BERT's ``position_ids`` and ``token_type_ids``, rotary ``inv_freq``), which the
module's constructor computed and a meta-device build left without values. This module
computes them the way ``transformers``' ``from_pretrained`` does for a model it builds on
meta (``PreTrainedModel._move_missing_keys_from_meta_to_device``, then
``_initialize_missing_keys``: an empty tensor on the target device, filled by the model's
``_init_weights``), and for plain torch modules by the torch convention that a module
(re)computes its own state in ``reset_parameters()``:

1. Each module owning such a buffer is *cloned* (``copy.copy``: same class, same
   attributes such as ``config``), with no children, a fresh empty tensor on the target
   device for each buffer to compute, and a ``meta`` stand-in for every other tensor, so
   nothing the checkpoint gave the module can be overwritten.
2. On the clone run, in order, until every wanted buffer is written: the ``_init_weights``
   of the nearest ``transformers.PreTrainedModel`` at or above the owner (transformers 5
   computes non-persistent buffers there), then the clone's own ``reset_parameters()``.
3. A buffer counts as computed only when that code wrote it: its version counter moved
   (every in-place write bumps it) or the code put a real tensor of the same shape and
   dtype in its place. Empty memory is never taken for a value.

Parameters are never computed: a weight the checkpoint lacks is not the model's, whatever
an initialiser would draw. Whatever is left raises :class:`MissingTensorError` naming each
tensor and why, before anything in the module changes.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from weightcache.core.errors import MissingTensorError


@dataclass
class _Owner:
    """One module owning buffers to compute: its dotted path and the wanted attributes,
    each with every name (aliases included) under which the module reaches it."""

    path: str
    module: nn.Module
    wanted: dict[str, list[str]] = field(default_factory=dict)


#: One computed value and where it goes: owning module, attribute, value.
Fill = tuple[nn.Module, str, torch.Tensor]


#: Each distinct tensor of a module with every name reaching it, and whether it is a
#: parameter (``_module._alias_groups``).
Groups = list[tuple[list[str], torch.Tensor, bool]]


def compute_missing(
    module: nn.Module, groups: Groups, present: Collection[str], device: torch.device
) -> list[Fill]:
    """The values of ``module``'s meta-device tensors that no name in ``present`` covers,
    computed on ``device`` by the module's own code (module docstring). Changes nothing:
    the caller installs them (:func:`install`).

    Args:
        module: the model, usually built on the ``meta`` device.
        groups: its tensors, each with every name reaching it (tied ones together).
        present: the names the checkpoint gives a tensor to (a tensor reached by several
            names is covered when one of them is present).
        device: where the computed tensors live (the loaded tensors' device).

    Returns:
        ``(owner, attribute, tensor)`` per computed buffer; shapes and dtypes those the
        module declared.

    Raises:
        MissingTensorError: a parameter is on ``meta`` and not in the checkpoint, or a
            buffer's owner computes no value for it; ``names`` lists each, the message why.
    """
    owners: dict[int, _Owner] = {}
    refused: dict[str, str] = {}
    for names, tensor, is_param in groups:
        if not tensor.is_meta or any(n in present for n in names):
            continue
        if is_param:
            refused[names[0]] = "a parameter the checkpoint lacks (weights are never computed)"
            continue
        path, _, attr = names[0].rpartition(".")
        owner = module.get_submodule(path) if path else module
        owners.setdefault(id(owner), _Owner(path, owner)).wanted[attr] = names
    fills: list[Fill] = []
    for found in owners.values():
        values, why = _compute(module, found, device)
        for attr, names in found.wanted.items():
            if attr not in values:
                refused[names[0]] = why
                continue
            fills.extend((*_owner_of(module, name), values[attr]) for name in names)
    if refused:
        raise MissingTensorError.of(refused)
    return fills


def install(fills: list[Fill]) -> None:
    """Put computed buffers (:func:`compute_missing`) into their modules."""
    for owner, attr, value in fills:
        owner._buffers[attr] = value


def _owner_of(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def _compute(
    root: nn.Module, owner: _Owner, device: torch.device
) -> tuple[dict[str, torch.Tensor], str]:
    """The wanted buffers of ``owner`` that its own code computes, and, for the rest, why
    not (the initialisers tried and what they raised)."""
    clone, blanks = _clone(owner, device)
    tried: list[str] = []
    values: dict[str, torch.Tensor] = {}
    for label, initialise in _initialisers(root, owner.path, clone):
        try:
            with torch.no_grad():
                initialise()
        except Exception as exc:  # any failure means "not computed"; the error names it
            tried.append(f"{label} raised {type(exc).__name__}: {exc}")
        else:
            tried.append(f"{label} did not write it")
        values.update(_written(clone, blanks, device))
        if len(values) == len(owner.wanted):
            break
    kind = type(owner.module).__name__
    if not tried:
        why = (
            f"a buffer the checkpoint lacks, which its module ({kind}) has no code to "
            "compute (no transformers _init_weights above it, no reset_parameters())"
        )
    else:
        why = f"a buffer the checkpoint lacks, not computed by its module ({kind}): " + "; ".join(
            tried
        )
    return values, why


def _clone(
    owner: _Owner, device: torch.device
) -> tuple[nn.Module, dict[str, tuple[torch.Tensor, int]]]:
    """A shallow copy of the owner with no children, a fresh empty tensor on ``device``
    per wanted buffer (with its version counter at creation) and a ``meta`` stand-in for
    every other tensor."""
    clone = copy.copy(owner.module)
    clone.__dict__.pop("_is_hf_initialized", None)  # transformers' "skip me" mark
    clone._modules = {}
    clone._parameters = {
        k: None if p is None else nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for k, p in owner.module._parameters.items()
    }
    blanks: dict[str, tuple[torch.Tensor, int]] = {}
    buffers: dict[str, torch.Tensor | None] = {}
    for k, b in owner.module._buffers.items():
        if b is not None and k in owner.wanted:
            blank = torch.empty_like(b, device=device)
            blanks[k] = (blank, blank._version)
            buffers[k] = blank
        else:
            buffers[k] = None if b is None else torch.empty_like(b, device="meta")
    clone._buffers = buffers
    return clone, blanks


def _written(
    clone: nn.Module, blanks: dict[str, tuple[torch.Tensor, int]], device: torch.device
) -> dict[str, torch.Tensor]:
    """The wanted buffers the clone's code wrote in place, or replaced by a real tensor
    of the declared shape and dtype."""
    out: dict[str, torch.Tensor] = {}
    for attr, (blank, version) in blanks.items():
        now = clone._buffers.get(attr)
        if now is blank and blank._version != version:
            out[attr] = blank
        elif (
            isinstance(now, torch.Tensor)
            and now is not blank
            and not now.is_meta
            and now.shape == blank.shape
            and now.dtype == blank.dtype
        ):
            out[attr] = now.to(device)
    return out


def _initialisers(
    root: nn.Module, path: str, clone: nn.Module
) -> list[tuple[str, Callable[[], object]]]:
    """The module's own code that may compute its buffers, in the order tried."""
    found: list[tuple[str, Callable[[], object]]] = []
    pretrained = _nearest_pretrained(root, path)
    if pretrained is not None:
        init_weights = cast(Callable[[nn.Module], object], pretrained._init_weights)
        label = f"{type(pretrained).__name__}._init_weights"
        found.append((label, lambda: init_weights(clone)))
    reset = getattr(clone, "reset_parameters", None)
    if callable(reset):
        found.append((f"{type(clone).__name__}.reset_parameters", reset))
    return found


def _nearest_pretrained(root: nn.Module, path: str) -> nn.Module | None:
    """The ``transformers.PreTrainedModel`` nearest above (or at) the module at ``path``:
    the one whose ``_init_weights`` ``from_pretrained`` applies to it (its
    ``initialize_weights``/``smart_apply`` hands each sub-model its own). None when
    transformers' ``modeling_utils`` is not imported (then no module is one)."""
    # Not imported unless a model of it exists: no transformers import for plain modules.
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    if base is None:
        return None
    chain = [root]
    node = root
    for part in path.split(".") if path else []:
        node = node.get_submodule(part)
        chain.append(node)
    return next((m for m in reversed(chain) if isinstance(m, base)), None)
