"""The weightcache daemon: serves preloaded weights over gRPC (see ``weightcache_service.cli``)."""

import os as _os

# Before anything imports grpc (weightcache's package sets it on for workers): the daemon
# is a grpc.aio server, which gRPC's fork support does not cover, and it never forks.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
