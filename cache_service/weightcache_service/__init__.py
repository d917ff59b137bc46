"""The weightcache daemon: serves preloaded weights over gRPC (see ``weightcache_service.cli``)."""
