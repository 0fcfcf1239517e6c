"""Networks that algorithms learn and rollouts act with: ``mlp`` (built), ``spec`` (what a published spec says,
read without torch), ``acting`` (acting from a spec), ``weights`` (the wire form)."""
