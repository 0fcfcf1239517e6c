"""Benchmarks of tinker-atropos against the simulator alone and its peers: ``python -m bench --help``."""
