"""The colocated HQ and fast vLLM pair: profiles, launcher, tiny model and the `up` command."""
