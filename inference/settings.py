"""Typed settings of `gpu-watchdog serve`, validated once at start."""

from __future__ import annotations

from dataclasses import dataclass


class SettingsError(ValueError):
    """A setting that cannot be used; the message names the flag."""


@dataclass(frozen=True)
class ServeSettings:
    model: str | None = None
    device: str = "auto"
    host: str = "0.0.0.0"
    port: int = 8000
    control_host: str = "127.0.0.1"
    control_port: int = 8001
    max_concurrency: int | None = None  # None = auto: from the memory budget on CUDA
    batch_window_ms: float = 50.0
    max_batch_size: int = 8
    queue_timeout: float = 30.0
    max_queue: int = 256
    max_tokens_limit: int = 512
    default_max_tokens: int = 16
    fault_injection: bool = False
    token_file: str | None = None
    memory_watermark: float = 0.85
    reserve_ratio: float = 0.12
    retry_after_s: int = 1
    shutdown_grace_s: float = 25.0
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0
    poison_linger_s: float = 10.0
    cpu_default_concurrency: int = 8
    memory_fraction: float | None = None  # this process's share of the GPU

    def __post_init__(self) -> None:
        checks = [
            (self.device in ("auto", "cpu", "cuda"), "--device must be auto, cpu or cuda"),
            (1 <= self.port <= 65535, "--port must be between 1 and 65535"),
            (0 <= self.control_port <= 65535, "--control-port must be between 0 and 65535"),
            (self.max_concurrency is None or self.max_concurrency >= 1, "--max-concurrency must be >= 1 or auto"),
            (0 <= self.batch_window_ms <= 10_000, "--batch-window-ms must be between 0 and 10000"),
            (1 <= self.max_batch_size <= 1024, "--max-batch-size must be between 1 and 1024"),
            (self.queue_timeout > 0, "--queue-timeout must be positive"),
            (self.max_queue >= 1, "--max-queue must be >= 1"),
            (self.body_timeout_s > 0, "--body-timeout must be positive"),
            (1 <= self.max_tokens_limit <= 1 << 20, "--max-tokens-limit must be >= 1"),
            (0 < self.memory_watermark <= 1, "--memory-watermark must be in (0, 1]"),
            (0 <= self.reserve_ratio < 1, "--reserve must be in [0, 1)"),
            (self.memory_fraction is None or 0 < self.memory_fraction <= 1, "--memory-fraction must be in (0, 1]"),
        ]
        for ok, message in checks:
            if not ok:
                raise SettingsError(message)
