"""Tests that need a CUDA or ROCm device (marker ``gpu``); see ``conftest.py``."""
