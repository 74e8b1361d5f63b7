"""The sidecar's commands and the loading of their configuration."""
