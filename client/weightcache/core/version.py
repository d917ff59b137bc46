"""Package and protocol versions.

``__version__`` is the one place the package's version is written: ``pyproject.toml``
reads it (``[tool.setuptools.dynamic]``), so the installed metadata says the same, and no
process pays ``importlib.metadata`` (about 10 ms of every daemon start and admin command,
issue 39) to learn it.
"""

from __future__ import annotations

#: The package's version (PEP 440).
__version__ = "0.1.0"

#: The wire protocol: the proto package.
PROTOCOL_VERSION = "weightcache.v1"
