"""Typed settings of `gpu-watchdog serve`, validated once at start; the command-line flags are generated from them.

Each flag is defined here once: the parser (`add_flags`), the mapping back to settings
(`from_args`) and the argv `gpu-watchdog up` passes to its child (`to_argv`) all read the same
field list. Imports nothing but the standard library: the sidecar's CLI reads it without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# Prompt tokens one decode step prefills, cached beginnings left out (vLLM's CPU server budgets its
# steps alike).
DEFAULT_PREFILL_TOKENS = 2048


class SettingsError(ValueError):
    """A setting that cannot be used; the message names the flag."""


def _whole(value: str, least: int, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(what) from None
    if n < least:
        raise argparse.ArgumentTypeError(what)
    return n


def _positive_int(value: str) -> int:
    return _whole(value, 1, "must be a positive integer")


def _non_negative_float(value: str) -> float:
    try:
        n = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number of seconds") from None
    if not n >= 0 or n == float("inf"):
        raise argparse.ArgumentTypeError("must be a number of seconds, 0 or more")
    return n


def _concurrency(value: str) -> int | None:
    return None if value == "auto" else _whole(value, 1, "must be a positive integer or 'auto'")


def _mib_or_auto(value: str) -> int | None:
    return None if value == "auto" else _whole(value, 0, "must be a number of MiB (0 = off) or 'auto'")


# The prefix cache's size when not given: in host memory on CPU; on a GPU it would come out of the
# admission budget, so it is given explicitly there.
CPU_PREFIX_CACHE_MIB = 1024


BUILTIN_HANDLERS = ("causal-lm", "embeddings", "classifier")


def _module_attr(spec: str) -> bool:
    module, _, attr = spec.partition(":")
    return all(part.isidentifier() for part in module.split(".")) and attr.isidentifier()


def _show_concurrency(value: object) -> str:
    return "auto" if value is None else str(value)


def flag(name: str, help: str | None = None, *, parse: Callable[[str], Any] | None = None,
         metavar: str | None = None, choices: tuple[str, ...] | None = None, switch: bool = False,
         show: Callable[[object], str] = str, serve_only: bool = False) -> dict[str, Any]:
    """Field metadata that makes a setting a command-line flag."""
    return {"flag": {"name": name, "help": help, "parse": parse, "metavar": metavar, "choices": choices,
                     "switch": switch, "show": show, "serve_only": serve_only}}


@dataclass(frozen=True)
class ServeSettings:
    model: str | None = field(default=None, metadata=flag(
        "--model", "local Hugging Face model directory (default: built-in model)", metavar="DIR"))
    handler: str = field(default="causal-lm", metadata=flag(
        "--handler", "what the model does: causal-lm, embeddings, classifier, or module:attr (your own"
        " handler class) (default: causal-lm)", metavar="NAME|module:attr"))
    served_model_name: str | None = field(default=None, metadata=flag(
        "--served-model-name", "the model id clients send and GET /v1/models lists (default: the model"
        " directory's name, or the built-in model's)", metavar="NAME"))
    device: str = field(default="auto", metadata=flag("--device", choices=("auto", "cpu", "cuda")))
    host: str = field(default="0.0.0.0", metadata=flag("--host"))
    port: int = field(default=8000, metadata=flag("--port", parse=int))
    workers: int = field(default=1, metadata=flag(
        "--workers", "server processes, one per GPU (CUDA_VISIBLE_DEVICES=k each), behind this one port;"
        " worker k's control API on --control-port + k (default: 1)", parse=_positive_int, metavar="N",
        serve_only=True))
    unix_socket: str | None = field(default=None, metadata=flag(
        "--unix-socket", "answer the public API on this Unix socket instead of --host/--port (what each"
        " worker of --workers does)", metavar="PATH", serve_only=True))
    control_host: str = "127.0.0.1"
    control_port: int = field(default=8001, metadata=flag("--control-port", parse=int))
    max_concurrency: int | None = field(default=None, metadata=flag(
        "--max-concurrency", "admission limit; auto = measured memory budget on CUDA, a fixed number of"
        " slots on CPU (default: auto)", parse=_concurrency, metavar="N|auto", show=_show_concurrency))
    max_batch_size: int = field(default=256, metadata=flag(
        "--max-batch-size", "most sequences decoding together; admission by memory usually binds first"
        " (default: 256; 1 = no batching)", parse=_positive_int))
    # The causal LM has no window (a request joins the running batch at the next step) and warns
    # when given one; request-level handlers wait this long for more items (None = 0: never wait).
    batch_window_ms: float | None = field(default=None, metadata=flag(
        "--batch-window-ms", "request-level handlers: how long the first queued item waits for more"
        " (default 0: take what is queued, never wait); the causal LM ignores it", parse=float, metavar="MS"))
    max_batch_tokens: int = field(default=16384, metadata=flag(
        "--max-batch-tokens", "request-level handlers: padded tokens in one forward pass (default: 16384)",
        parse=_positive_int))
    max_prefill_tokens: int = field(default=DEFAULT_PREFILL_TOKENS, metadata=flag(
        "--max-prefill-tokens", "causal LM: prompt tokens one step prefills (cached beginnings left out); a longer"
        f" prompt is prefilled a chunk per step, the running sequences decoding between chunks (default:"
        f" {DEFAULT_PREFILL_TOKENS})",
        parse=_positive_int))
    prefix_cache_mib: int | None = field(default=None, metadata=flag(
        "--prefix-cache", "causal LM: MiB of prompt beginnings' keys and values kept for prompts that start the"
        f" same way (0 = off); auto = {CPU_PREFIX_CACHE_MIB} on CPU, off on CUDA, where the size given comes out"
        " of the admission budget (default: auto)", parse=_mib_or_auto, metavar="MIB|auto", show=_show_concurrency))
    queue_timeout: float = field(default=30.0, metadata=flag(
        "--queue-timeout", "seconds a request may wait for admission before a 503", parse=float, metavar="S"))
    max_queue: int = field(default=256, metadata=flag("--max-queue", parse=_positive_int))
    max_tokens_limit: int = field(default=512, metadata=flag("--max-tokens-limit", parse=_positive_int))
    default_max_tokens: int = 16
    fault_injection: bool = field(default=False, metadata=flag(
        "--fault-injection", "enable POST /control/fault (tests only)", switch=True))
    quarantine_wait: float = field(default=0.0, metadata=flag(
        "--quarantine-wait", "seconds a new process stays unready, answering 503, for its sidecar's quarantine"
        " list once its model is loaded, then serves without it (0 = serve at once; the chart sets it where"
        " the fleet's quarantine is on)", parse=_non_negative_float, metavar="S"))
    token_file: str | None = field(default=None, metadata=flag(
        "--token-file", "control token file (GPU_WATCHDOG_TOKEN wins)", metavar="FILE", serve_only=True))
    memory_watermark: float = 0.85
    reserve_ratio: float = 0.12
    retry_after_s: int = 1
    shutdown_grace_s: float = 25.0
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = field(default=10.0, metadata=flag(
        "--body-timeout", "answer 408 to a client that has not sent its whole body within S seconds",
        parse=float, metavar="S"))
    poison_linger_s: float = 10.0
    # On CPU there is no allocator to measure; enough slots that batching, not this, sets the pace.
    cpu_default_concurrency: int = 64
    memory_fraction: float | None = field(default=None, metadata=flag(
        "--memory-fraction", "cap this process's share of the GPU (workers sharing a card; emulating a"
        " smaller one)", parse=float, metavar="F"))

    def __post_init__(self) -> None:
        checks = [
            (self.device in ("auto", "cpu", "cuda"), "--device must be auto, cpu or cuda"),
            (1 <= self.port <= 65535, "--port must be between 1 and 65535"),
            (1 <= self.workers <= 64, "--workers must be between 1 and 64"),
            (self.workers == 1 or self.unix_socket is None, "--unix-socket is one worker's; not with --workers"),
            (0 <= self.control_port <= 65535, "--control-port must be between 0 and 65535"),
            (self.max_concurrency is None or self.max_concurrency >= 1, "--max-concurrency must be >= 1 or auto"),
            (1 <= self.max_batch_size <= 4096, "--max-batch-size must be between 1 and 4096"),
            (self.queue_timeout > 0, "--queue-timeout must be positive"),
            (self.max_queue >= 1, "--max-queue must be >= 1"),
            (self.body_timeout_s > 0, "--body-timeout must be positive"),
            (1 <= self.max_tokens_limit <= 1 << 20, "--max-tokens-limit must be >= 1"),
            (0 < self.memory_watermark <= 1, "--memory-watermark must be in (0, 1]"),
            (0 <= self.reserve_ratio < 1, "--reserve must be in [0, 1)"),
            (self.memory_fraction is None or 0 < self.memory_fraction <= 1, "--memory-fraction must be in (0, 1]"),
            (self.served_model_name is None or bool(self.served_model_name.strip()),
             "--served-model-name must not be empty"),
            (self.handler in BUILTIN_HANDLERS or _module_attr(self.handler),
             f"--handler must be one of {', '.join(BUILTIN_HANDLERS)} or module:attr"),
            (self.handler in ("causal-lm",) or ":" in self.handler or self.model is not None,
             f"--handler {self.handler} needs --model DIR (a local Hugging Face directory)"),
            (self.batch_window_ms is None or 0 <= self.batch_window_ms <= 10_000,
             "--batch-window-ms must be between 0 and 10000"),
        ]
        for ok, message in checks:
            if not ok:
                raise SettingsError(message)


def _flags(include_serve_only: bool = True) -> Iterable[tuple[dataclasses.Field[Any], dict[str, Any]]]:
    for f in dataclasses.fields(ServeSettings):
        spec = f.metadata.get("flag")
        if spec is not None and (include_serve_only or not spec["serve_only"]):
            yield f, spec


def add_flags(parser: argparse.ArgumentParser, for_up: bool = False) -> None:
    """Add every serve flag to `parser` (`up` leaves out those it sets itself)."""
    for f, spec in _flags(include_serve_only=not for_up):
        if spec["switch"]:
            parser.add_argument(spec["name"], dest=f.name, action="store_true", help=spec["help"])
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": spec["help"]}
        for key, arg in (("parse", "type"), ("metavar", "metavar"), ("choices", "choices")):
            if spec[key] is not None:
                kwargs[arg] = spec[key]
        parser.add_argument(spec["name"], **kwargs)


def from_args(args: argparse.Namespace, **extra: Any) -> ServeSettings:
    """Settings from parsed flags; raises SettingsError naming the flag at fault."""
    values = {f.name: getattr(args, f.name) for f, _ in _flags() if hasattr(args, f.name)}
    return ServeSettings(**values, **extra)


def to_argv(settings: ServeSettings) -> list[str]:
    """The flags that reproduce `settings` (non-default values only), e.g. for a child `serve`."""
    argv: list[str] = []
    for f, spec in _flags():
        value = getattr(settings, f.name)
        if value == f.default:
            continue
        if spec["switch"]:
            argv.append(spec["name"])
        else:
            argv += [spec["name"], spec["show"](value)]
    return argv
