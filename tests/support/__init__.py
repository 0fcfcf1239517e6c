"""Envs and helpers for the tests and the benchmarks (bench/ imports them; they never import bench/): imported by
service processes through `env.id`."""
