"""Fakes that tests and benchmarks both start or import: deployments that answer as vLLM does (fast and fixed,
deterministic for resuming, faulting on cue) and an OTLP trace receiver. The product never imports them."""
