"""The target server's own Prometheus page, read into one typed sample whatever the server.

vLLM, TGI, SGLang and the bundled server name the same ideas differently; each name below was
checked against the server's source (and, for vLLM, a real scrape). A page that is garbage,
hangs or names nothing we know is reported in the sample, never raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gpu_watchdog.watchdog.core.samples import ServerSample
from gpu_watchdog.watchdog.core.selector import Selector
from gpu_watchdog.watchdog.edge.samplers.http_body import read_capped

MAX_PAGE_BYTES = 8 * 2**20  # a metrics page is kilobytes; more is not a metrics page


@dataclass(frozen=True)
class Dialect:
    server: str
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    generated_tokens: tuple[str, ...]
    progress: tuple[str, ...]
    kv_cache_usage: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()
    nonfinite: tuple[str, ...] = ()  # steps failed for NaN or infinite logits (the bundled engine's)

    def names(self) -> Iterable[str]:
        return (*self.running, *self.waiting, *self.generated_tokens, *self.progress, *self.kv_cache_usage,
                *self.preemptions, *self.nonfinite)


# Sample names as exposed (counters with their `_total`). For each figure the first name present
# wins, except progress, which adds up every counter named: prompt tokens count too, so that a
# long prefill, which generates nothing for a while, is progress. Only whether the sum moves
# matters, so counters kept by different rules may be added.
DIALECTS = (
    # vllm/v1/metrics/loggers.py (PrometheusStatLogger); kv: gpu_cache_usage_perc before v1.
    # Generated tokens are counted at every step, a prompt's tokens once its prefill is done.
    Dialect("vllm", running=("vllm:num_requests_running",), waiting=("vllm:num_requests_waiting",),
            generated_tokens=("vllm:generation_tokens_total",),
            progress=("vllm:generation_tokens_total", "vllm:prompt_tokens_total"),
            kv_cache_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            preemptions=("vllm:num_preemptions_total",)),
    # python/sglang/srt/metrics/collector.py (needs --enable-metrics); retractions are its preemptions.
    # Its prompt and generation totals grow only when a request finishes; the scheduler's
    # realtime_tokens_total{mode=prefill_compute|prefill_cache|decode} (newer releases) as it
    # prefills and decodes, so a long request is progress before it ends.
    Dialect("sglang", running=("sglang:num_running_reqs",), waiting=("sglang:num_queue_reqs",),
            generated_tokens=("sglang:generation_tokens_total",),
            progress=("sglang:generation_tokens_total", "sglang:prompt_tokens_total", "sglang:realtime_tokens_total"),
            kv_cache_usage=("sglang:token_usage",), preemptions=("sglang:num_retracted_requests_total",)),
    # router/src (metrics crate, exported without `_total`). Tokens are observed when a request
    # ends, so progress is the count of successful prefill/decode steps.
    Dialect("tgi", running=("tgi_batch_current_size",), waiting=("tgi_queue_size",),
            generated_tokens=("tgi_request_generated_tokens_sum",),
            progress=("tgi_batch_inference_success", "tgi_batch_inference_success_total")),
    # inference/metrics.py: generated tokens are counted at every decode step, prompt tokens at every
    # prefill pass and every chunk of a long prompt (vLLM counts a prompt only once it is prefilled).
    Dialect("bundled", running=("gpu_inference_inflight_requests",), waiting=("gpu_inference_queued_requests",),
            generated_tokens=("gpu_inference_generated_tokens_total",),
            progress=("gpu_inference_generated_tokens_total", "gpu_inference_prompt_tokens_total"),
            nonfinite=("gpu_inference_nonfinite_total",)),
)


KNOWN_NAMES = frozenset(n for d in DIALECTS for n in d.names())
_NAME_END = re.compile(r"[{\s]")


def wanted_lines(text: str, names: frozenset[str] = KNOWN_NAMES) -> str:
    """Only the sample lines of the series we read.

    A busy vLLM's page is mostly histogram buckets; parsing all of it costs the sidecar tens of
    milliseconds of CPU per scrape, on a machine the server already saturates. Comment lines go
    too: without its TYPE line a counter's sample keeps its exposed name (`..._total`).
    """
    keep = []
    for line in text.splitlines():
        if line[:1] in ("#", ""):
            continue
        end = _NAME_END.search(line)
        if end is not None and line[:end.start()] in names:
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse(text: str, at: float, worker: str | None = None) -> ServerSample:
    """One sample from exposition text; a page that is not Prometheus text is an unreachable sample.

    `worker`: on the page of `serve --workers N`, which labels each worker's series `worker`, only
    that worker's: the others' progress must not make the watched one look busy while it hangs."""
    sums: dict[str, float] = {}
    if text.strip() and not wanted_lines(text).strip() and not _looks_like_exposition(text):
        return ServerSample(at=at, reachable=False, error="bad_response: not Prometheus text")
    try:
        for family in text_string_to_metric_families(wanted_lines(text)):
            for s in family.samples:
                if worker is not None and s.labels.get("worker", worker) != worker:
                    continue
                # Several engines or models behind one server each carry their own series: add them up.
                sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on garbage
        return ServerSample(at=at, reachable=False, error=f"bad_response: not Prometheus text: {exc}"[:300])
    for d in DIALECTS:
        if not any(name in sums for name in d.names()):
            continue

        def first(names: tuple[str, ...]) -> float | None:
            return next((sums[n] for n in names if n in sums), None)

        def total(names: tuple[str, ...]) -> float | None:
            present = [sums[n] for n in names if n in sums]
            return sum(present) if present else None

        return ServerSample(at=at, reachable=True, server=d.server, requests_running=first(d.running),
                            requests_waiting=first(d.waiting), generated_tokens=first(d.generated_tokens),
                            progress=total(d.progress), kv_cache_usage_ratio=first(d.kv_cache_usage),
                            preemptions=first(d.preemptions), nonfinite=first(d.nonfinite))
    return ServerSample(at=at, reachable=True, server="unknown")


def _looks_like_exposition(text: str) -> bool:
    """A page with none of our series: still a metrics page if the parser takes it."""
    try:
        for _ in text_string_to_metric_families(text):
            pass
    except Exception:
        return False
    return True


def progress_of(text: str, selector: Selector) -> float | None:
    """The sum of the series `target.progress_metric` names (None when the page has none of them).

    Only the lines of that name are parsed: a busy server's page is mostly histogram buckets.
    """
    names = (selector.name, selector.name + "_total", selector.name.removesuffix("_total"))
    lines = [line for line in text.splitlines()
             if line[:1] not in ("#", "") and line.split("{", 1)[0].split(" ", 1)[0] in names]
    total: float | None = None
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for s in family.samples:
                if selector.matches(s.name, s.labels):
                    total = (total or 0.0) + float(s.value)
    except Exception:  # a garbled line: no reading, never a crash
        return None
    return total


class ServerMetricsSampler:
    def __init__(self, url: str, session: aiohttp.ClientSession, clock: Callable[[], float], timeout: float,
                 headers: Callable[[], dict[str, str]] = dict, progress: Selector | None = None,
                 worker: str | None = None) -> None:
        self.url = url
        self.worker = worker
        # A counter of finished work named in config replaces the dialect's own.
        self.progress = progress
        self.session = session
        self.clock = clock
        self.timeout = timeout
        self.headers = headers

    async def sample(self) -> ServerSample:
        try:
            async with self.session.get(self.url, headers=self.headers(),
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                if resp.status != 200:
                    return ServerSample(at=self.clock(), reachable=False,
                                        error=f"bad_response: {self.url} answered {resp.status}")
                body = await read_capped(resp, MAX_PAGE_BYTES)
        except TimeoutError:
            return ServerSample(at=self.clock(), reachable=False, error=f"timeout: no page within {self.timeout:g}s")
        except aiohttp.ClientError as exc:
            return ServerSample(at=self.clock(), reachable=False, error=f"unreachable: {exc}"[:300])
        if len(body) > MAX_PAGE_BYTES:
            return ServerSample(at=self.clock(), reachable=False, error="bad_response: page over 8 MiB")
        text = body.decode("utf-8", errors="replace")
        # Off the event loop: the sidecar's own probes must answer while the machine is saturated.
        return self._with_progress(await asyncio.to_thread(parse, text, self.clock(), self.worker), text)

    def _with_progress(self, sample: ServerSample, text: str) -> ServerSample:
        if self.progress is None or not sample.reachable:
            return sample
        return dataclasses.replace(sample, progress=progress_of(text, self.progress))
