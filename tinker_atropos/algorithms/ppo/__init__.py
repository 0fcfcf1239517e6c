"""PPO (clipped objective, GAE), split the Acme way: networks, learning; acting lives with the rollout."""
