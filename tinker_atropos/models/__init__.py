"""Networks that algorithms learn and rollouts act with: ``mlp`` (built), ``acting`` (acting from a spec), ``weights`` (the wire form)."""
