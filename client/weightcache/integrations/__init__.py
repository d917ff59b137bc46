"""Integrations of weightcache into model servers; each needs its server installed."""
