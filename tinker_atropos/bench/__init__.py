"""``tinker-atropos bench``: the system's throughput next to the simulator alone, EnvPool and Stable-Baselines3,
measured in one run on one machine so that the ratios mean something even where absolute figures are noisy."""
