"""Installing held tensors in a model built on the meta device, without copying them.

The engine side of the ``vllm`` recipe (:mod:`.recipe`): vLLM's model is built on the meta
device (no memory), then every parameter and buffer the daemon holds under its vLLM name
takes the daemon's tensor itself (a view of the worker's mapping of the arena). Imports
torch only, so that it is tested without vLLM.

A parameter keeps its class and attributes (vLLM's parameters carry their weight loaders
and shard dimensions as attributes, which processing may read): the new parameter is
made with ``torch.Tensor._make_subclass`` of the meta parameter's class, as
``nn.Parameter.__new__`` does, and takes the meta parameter's ``__dict__``. Every name
under which the model reaches one meta tensor (tied weights, a rotary module shared by
layers) gets the same new object, so ties stay ties.

Every parameter and buffer of the model must be held (``docs/protocol.md``, "No tensor
left uninitialized"): a model with a tensor the daemon does not hold is refused whole
(:class:`InstallError`), never given uninitialized memory, and the engine loads another
way (``docs/vllm.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from weightcache.core.errors import WeightCacheError

#: How many names an :class:`InstallError` lists before it counts the rest.
MAX_NAMED = 8


class InstallError(WeightCacheError, ValueError):
    """The held tensors do not fit the engine's model (a name it lacks, another shape or
    dtype, a parameter or buffer of the model no held tensor gives): the weights were made
    for another model, and nothing may be installed. Reason ``INSTALL_FAILED`` (a client
    code: no daemon sends it)."""

    reason = "INSTALL_FAILED"


@dataclass
class Installed:
    """What :func:`install` did.

    Attributes:
        tensors: held tensors installed (each once, whatever its number of names).
        names: model names that now hold a held tensor (aliases included).
    """

    tensors: int = 0
    names: int = 0


@dataclass
class _Place:
    """Where one meta tensor sits in the model: each (module, attribute, is parameter)."""

    meta: torch.Tensor
    slots: list[tuple[nn.Module, str, bool]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


def _places(model: nn.Module) -> tuple[dict[int, _Place], dict[str, int]]:
    places: dict[int, _Place] = {}
    by_name: dict[str, int] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for kind, table in ((True, module._parameters), (False, module._buffers)):
            for leaf, tensor in table.items():
                if tensor is None:
                    continue
                place = places.setdefault(id(tensor), _Place(tensor))
                place.slots.append((module, leaf, kind))
                place.names.append(dot + leaf)
                by_name.setdefault(dot + leaf, id(tensor))
    return places, by_name


def _new_object(meta: torch.Tensor, tensor: torch.Tensor, is_param: bool) -> torch.Tensor:
    if not is_param:
        return tensor
    # nn.Parameter.__new__ makes its object this way; a subclass of vLLM keeps its class.
    param = torch.Tensor._make_subclass(type(meta), tensor, False)
    param.__dict__.update(meta.__dict__)
    return param


def install(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Installed:
    """Put ``tensors`` (name -> tensor, vLLM names) in ``model`` in place of its tensors.

    Every name must be a parameter or buffer of ``model`` with the same shape and dtype,
    and every parameter and buffer of ``model`` on the meta device must get a tensor (under
    one of its names): none is left without a value.

    Raises:
        InstallError: a name the model does not have, a shape or dtype other than the
            model's, or parameters or buffers of the model that no tensor gives (named:
            the first :data:`MAX_NAMED`, then their count); checked before anything is
            installed.
    """
    places, by_name = _places(model)
    chosen: list[tuple[_Place, torch.Tensor]] = []
    for name, tensor in tensors.items():
        key = by_name.get(name)
        if key is None:
            raise InstallError(f"held tensor {name!r} is not a parameter or buffer of the model")
        place = places[key]
        if (place.meta.shape, place.meta.dtype) != (tensor.shape, tensor.dtype):
            raise InstallError(
                f"held tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}; the model "
                f"has {tuple(place.meta.shape)} {place.meta.dtype}"
            )
        chosen.append((place, tensor))
    # A tensor the constructor made off the meta device (on a device it names) has the
    # value vLLM's own code gave it; one still on meta has none.
    given = {id(place.meta) for place, _ in chosen}
    missing = [
        name
        for key, place in places.items()
        if key not in given and place.meta.is_meta
        for name in place.names
    ]
    if missing:
        raise InstallError(
            f"the daemon holds no tensor for {len(missing)} parameter(s) or buffer(s) of the "
            f"model: {_names(missing)}"
        )
    done = Installed()
    for place, tensor in chosen:
        new = {True: _new_object(place.meta, tensor, True), False: tensor}
        for module, leaf, is_param in place.slots:
            table = module._parameters if is_param else module._buffers
            table[leaf] = new[is_param]  # type: ignore[assignment]
        done.tensors += 1
        done.names += len(place.names)
    return done


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMED])
    return shown if len(names) <= MAX_NAMED else f"{shown} and {len(names) - MAX_NAMED} more"
