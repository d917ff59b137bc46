"""weightcache test suite."""
