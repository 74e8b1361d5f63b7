"""gpu-watchdog: the sidecar that keeps a GPU inference process healthy."""

from watchdog.contract import VERSION as __version__

__all__ = ["__version__"]
