"""gpu-watchdog: an inference process that concurrency cannot OOM and the sidecar that keeps it healthy.

Everything installs under this one name: `gpu_watchdog.inference` (the server and the in-process
agent), `gpu_watchdog.watchdog` (the sidecar), and beside them what both halves share — the
contract between them (`contract`), structured logging (`logs`) and units (`units`). Importing
this package imports neither half.
"""

from gpu_watchdog.contract import VERSION as __version__

__all__ = ["__version__"]
