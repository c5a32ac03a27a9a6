"""Engine worker: wraps an engine (sim or vLLM), serves it on NATS, publishes events."""
