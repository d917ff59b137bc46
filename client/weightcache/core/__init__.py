"""weightcache.core: the code the worker SDK and the daemon share.

Both sides must agree byte for byte on what a checkpoint is, how a recipe turns it into
tensors, what the fingerprint of the result is, and which reason code names which failure;
so that code lives here, once, and is public to the daemon (``weightcache_service``).

Modules (one concept each):

- ``checkpoint``: opening and validating safetensors checkpoints (file, sharded index, Hub
  snapshot) and reading their bytes;
- ``dtypes``: safetensors dtype names and their torch dtypes and element sizes;
- ``recipe``, ``pipeline``, ``tp``, ``plugins``: a recipe (dtype, tensor-parallel plan,
  plugins) and the processing graph it builds;
- ``fingerprint``, ``hashcache``: the identity of a recipe's output and the on-disk digest
  cache of the ``full`` level;
- ``errors``: the exception hierarchy and the reason codes the daemon sends;
- ``records``: the values the daemon reports (models, leases, arenas, server info);
- ``protocol``: every conversion between these domain objects and the protobuf messages;
- ``sockets``: where a device's daemon listens;
- ``rpc``: the gRPC channel and call helpers used by the SDK and the admin commands;
- ``cuda``: ctypes bindings to the CUDA/HIP IPC calls and device UUIDs;
- ``version``: the package and protocol versions.

Import direction (checked by ``tests/test_layers.py``): ``weightcache.core`` imports
neither the SDK's private modules nor the daemon; the SDK never imports the daemon; the
daemon imports only ``weightcache.core``, the public ``weightcache`` package and the
generated ``weightcache.v1`` stubs.
"""
