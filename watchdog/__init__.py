"""The sidecar: samplers -> policy -> actions, its probes and metrics, and its commands."""
