"""The edge: what performs I/O (samplers, the Kubernetes and control API clients, the effects, the
recorder, the metrics and the HTTP server). It reads and acts; the rules it follows live in the core."""
