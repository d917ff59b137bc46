"""Package and protocol versions."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("weightcache")
except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0+unknown"

#: The wire protocol: the proto package.
PROTOCOL_VERSION = "weightcache.v1"
