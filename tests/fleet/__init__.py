"""A simulated cluster for fleet tests: an API server with real write semantics, model servers, sidecars."""
