"""gpu-watchdog: the sidecar that keeps a GPU inference process healthy."""

__version__ = "0.1.0"
