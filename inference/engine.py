"""The synchronous generation engine. Everything here runs in worker threads, never on the event loop."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.errors import FatalCudaError
from inference.faults import FaultInjector
from inference.model import LoadedModel


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    on_text: Callable[[str], object] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class GenResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


@dataclass(frozen=True)
class EngineProbe:
    """What the engine observed itself, independent of the admission gate's own bookkeeping."""

    active_sequences: int
    peak_active_sequences: int
    forward_batches: int
    largest_batch: int
    # Distinct threads that ran a forward pass: on CUDA each keeps a cuBLAS workspace.
    threads: int


class Engine:
    def __init__(self, lm: LoadedModel, faults: FaultInjector | None = None,
                 on_tokens: Callable[[int], object] | None = None) -> None:
        self.lm = lm
        self.faults = faults
        # Called with each step's new tokens, not at the end of a request: a watcher reads the
        # counter as proof of progress, and a long generation must not look like a stalled one.
        self.on_tokens = on_tokens
        self._lock = threading.Lock()
        self._active = 0
        self._peak_active = 0
        self._batches = 0
        self._largest_batch = 0
        self._threads: set[int] = set()
        self.poisoned: str | None = None

    @property
    def is_cuda(self) -> bool:
        return self.lm.device.type == "cuda"

    def probe(self) -> EngineProbe:
        with self._lock:
            return EngineProbe(self._active, self._peak_active, self._batches, self._largest_batch,
                               len(self._threads))

    def reset_peak(self) -> None:
        with self._lock:
            self._peak_active = self._active

    def poison(self, reason: str) -> None:
        self.poisoned = reason

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Run one padded batch to completion; each request stops at its own max_tokens."""
        if self.poisoned is not None:
            raise FatalCudaError(self.poisoned)
        n = len(requests)
        with self._lock:
            self._active += n
            self._peak_active = max(self._peak_active, self._active)
            self._batches += 1
            self._largest_batch = max(self._largest_batch, n)
            self._threads.add(threading.get_ident())
        try:
            if self.faults is not None:
                self.faults.before_forward(self._active)
            with torch.inference_mode():
                return self._generate(requests)
        finally:
            with self._lock:
                self._active -= n

    def _generate(self, requests: list[GenRequest]) -> list[GenResult]:
        lm = self.lm
        dev = lm.device
        n = len(requests)
        longest = max(len(r.prompt_ids) for r in requests)
        # Left padding keeps every sequence's last token in the last column.
        ids = torch.full((n, longest), lm.codec.pad_id, dtype=torch.long)
        mask = torch.zeros((n, longest), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, longest - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, longest - len(r.prompt_ids):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        temps = torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=dev)
        greedy = temps <= 0
        decoders = [lm.codec.decoder() for _ in requests]
        texts: list[list[str]] = [[] for _ in requests]
        produced = [0] * n
        finish = ["length"] * n
        done = [False] * n
        cache: Any = None
        steps = max(r.max_tokens for r in requests)
        for step in range(steps):
            if step:
                # A sticky error fails every later kernel, including those of generations under way.
                if self.poisoned is not None:
                    raise FatalCudaError(self.poisoned)
                if self.faults is not None:
                    self.faults.during_forward(self._active)
            out = lm.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           **{lm.cache_kwarg: cache}, **lm.forward_extra)
            cache = getattr(out, "cache", None)
            if cache is None:
                cache = getattr(out, "past_key_values", None)
            logits = out.logits[:, -1, :].float()
            if lm.allowed_tokens is not None:
                logits = logits.masked_fill(~lm.allowed_tokens[: logits.shape[-1]], float("-inf"))
            next_ids = self._sample(logits, temps, greedy)
            host_ids = next_ids.tolist()
            before = sum(produced)
            for i, r in enumerate(requests):
                if done[i]:
                    continue
                tok = int(host_ids[i])
                if lm.codec.eos_id is not None and tok == lm.codec.eos_id:
                    done[i], finish[i] = True, "stop"
                    continue
                piece = decoders[i].feed([tok])
                produced[i] += 1
                if piece:
                    texts[i].append(piece)
                    if r.on_text is not None:
                        r.on_text(piece)
                if produced[i] >= r.max_tokens:
                    done[i] = True
                elif r.cancelled.is_set():
                    done[i], finish[i] = True, "cancelled"
            if self.on_tokens is not None and sum(produced) > before:
                self.on_tokens(sum(produced) - before)
            if all(done):
                break
            ids = next_ids[:, None]
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=1)
            positions = positions[:, -1:] + 1
        if self.is_cuda:
            torch.cuda.synchronize(dev)
        return [
            GenResult(
                text="".join(texts[i]),
                prompt_tokens=len(r.prompt_ids),
                completion_tokens=produced[i],
                finish_reason=finish[i],
            )
            for i, r in enumerate(requests)
        ]

    @staticmethod
    def _sample(logits: torch.Tensor, temps: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        best = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return best
        scaled = logits / temps.clamp(min=1e-4)[:, None]
        probs = torch.softmax(scaled, dim=-1)
        drawn = torch.multinomial(probs, 1).squeeze(-1)
        return torch.where(greedy, best, drawn)

    # -- allocator ---------------------------------------------------------------------------

    def memory(self) -> dict[str, Any]:
        """Allocator figures; honest zeros on CPU, where there is no CUDA allocator."""
        lm = self.lm
        figures: dict[str, Any] = {
            "device": lm.device.type,
            "device_name": "cpu",
            "uuid": None,
            "total_bytes": 0,
            "allocated_bytes": 0,
            "reserved_bytes": 0,
            "active_bytes": 0,
            "inactive_split_bytes": 0,
            "alloc_retries": 0,
            "num_ooms": 0,
        }
        if self.is_cuda:
            idx = lm.device.index if lm.device.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(idx)
            stats = torch.cuda.memory_stats(idx)
            uuid = getattr(props, "uuid", None)
            figures.update(
                device_name=props.name,
                uuid=None if uuid is None else _format_uuid(uuid),
                total_bytes=int(props.total_memory),
                allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
                reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
                active_bytes=int(stats.get("active_bytes.all.current", 0)),
                inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)),
                alloc_retries=int(stats.get("num_alloc_retries", 0)),
                num_ooms=int(stats.get("num_ooms", 0)),
            )
        return figures

    def empty_cache(self) -> int:
        """Return cached blocks to the driver; the bytes freed (0 on CPU)."""
        if not self.is_cuda:
            return 0
        before = torch.cuda.memory_reserved(self.lm.device)
        torch.cuda.empty_cache()
        return max(0, int(before - torch.cuda.memory_reserved(self.lm.device)))

    def reserved_ratio(self) -> float:
        if not self.is_cuda:
            return 0.0
        total = torch.cuda.get_device_properties(self.lm.device).total_memory
        return float(torch.cuda.memory_reserved(self.lm.device)) / float(total)


def _format_uuid(uuid: object) -> str:
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"
