"""The fingerprint levels: how much of a checkpoint's content the identity covers.

Their home, apart from :mod:`weightcache.core.fingerprint` (which re-exports them), so that
the ``weightcache`` command's parser names them without importing the fingerprint code.
"""

from __future__ import annotations

from typing import Literal

Level = Literal["layout", "sampled", "full"]
LEVELS: tuple[Level, ...] = ("layout", "sampled", "full")
#: The level used when none is named: by the daemon, the SDK and the wire (UNSPECIFIED).
DEFAULT_LEVEL: Level = "full"
