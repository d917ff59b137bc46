# The compiled weightcache._views (client/csrc/views.cpp, built by `make setup`).
from collections.abc import Sequence

import torch

def views(
    typed: Sequence[torch.Tensor],
    which: Sequence[int],
    ranks: Sequence[int],
    shape: Sequence[int],
    stride: Sequence[int],
    byte_offsets: Sequence[int],
    nbytes: Sequence[int],
    size: int,
) -> list[torch.Tensor]: ...
