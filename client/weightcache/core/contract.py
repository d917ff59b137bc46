"""Where the installed package keeps the ``weightcache.v1`` contract's ``.proto`` files.

The wheel ships a copy of the repository's ``protos/`` folder (``make protos`` copies it,
``make check-protos`` fails when it is stale), so that a build in another language can
generate its client from an installed package instead of a checkout.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

#: The contract's files, relative to :func:`proto_path`: ours, and the vendored
#: ``google.rpc`` files a client needs to decode the error details.
PROTO_FILES = (
    "weightcache/v1/weight_cache_service.proto",
    "google/rpc/status.proto",
    "google/rpc/error_details.proto",
    "google/rpc/code.proto",
)


def proto_path() -> Path:
    """The include folder of the contract: pass it to ``protoc -I`` (with the
    :data:`PROTO_FILES` to generate) or to a loader such as Node's ``@grpc/proto-loader``.

    The ``google/protobuf`` well-known types the contract imports come with every protoc
    and are not in it.

    >>> import weightcache
    >>> (weightcache.proto_path() / "weightcache/v1/weight_cache_service.proto").is_file()
    True

    Raises:
        FileNotFoundError: the package was installed without its ``protos`` data (a broken
            install; a wheel or an editable install has it).
    """
    folder = Path(str(resources.files("weightcache") / "protos"))
    if not (folder / PROTO_FILES[0]).is_file():
        raise FileNotFoundError(f"{folder / PROTO_FILES[0]}: the package ships no contract")
    return folder
