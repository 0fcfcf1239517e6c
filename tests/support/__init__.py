"""Envs and helpers that exist only for the tests: imported by service processes through `env.id`."""
