"""Scoring a prompt (`echo` + `logprobs`): its log-probabilities computed a bounded chunk of positions at a time.

Every position of a scored prompt predicts the next token, so its logits are `positions x vocab`:
for a 32k-token prompt and a 128k vocabulary, 16 GiB in fp32, twice over with the log-softmax.
Computed whole, one request could take the card; its OOMs would then lower the admission limit
for every client. Here the prefill keeps the final hidden states of every position (`positions x
hidden`, a small fraction of that) and only the last position's logits, and the head turns the
states into logits `chunk_positions(vocab)` positions at a time. The same arithmetic on the same
states: the answers are those of the whole computation (`tests/unit/test_scoring.py`).

The head is split off the forward pass only where the logits are nothing but the head's output:
the lean pass (`inference.lean`, which ends with norm and head) or a model whose own forward is
checked on a probe to return exactly what its output embeddings compute (no soft-capping, no
scaling after them). Any other model computes its pass's logits whole, as before, and only the
log-softmax runs in chunks; its admission weight counts the whole pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import structlog
import torch

from gpu_watchdog.inference.engine_api import TokenLogprob
from gpu_watchdog.inference.model import LoadedModel
from gpu_watchdog.inference.sampling import token_logprobs

log = structlog.get_logger(__name__)

# The fp32 logits of one chunk: 131 positions of a 128k vocabulary, 512 of a 32k one.
CHUNK_LOGITS_BYTES = 64 << 20
MAX_CHUNK_POSITIONS = 1024
# What one chunk holds at once: its logits (in fp32, and in the model's dtype while converted),
# the log-softmax and, for models with allowed tokens, the masked copy: three fp32 copies at most.
COPIES = 3

Head = Callable[[torch.Tensor], torch.Tensor]


def chunk_positions(vocab: int) -> int:
    """Positions whose logits one chunk computes together."""
    return max(1, min(MAX_CHUNK_POSITIONS, CHUNK_LOGITS_BYTES // (4 * max(vocab, 1))))


def working_set_bytes(prompt_tokens: int, vocab: int, positions: int) -> int:
    """What scoring a prompt holds at once beyond an ordinary prefill: the logits of `positions`
    positions at a time (the chunk, or the whole pass where the head cannot be split off)."""
    return COPIES * 4 * vocab * max(1, min(prompt_tokens, positions))


def kv_bytes(lm: LoadedModel, tokens: int) -> int:
    """The keys and values `tokens` tokens hold over every layer, from the model's config (0 when
    the config does not say): what one admission slot, a sequence at the longest length, holds at least."""
    config = getattr(lm.model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and heads:
        head_dim = int(getattr(config, "hidden_size", 0) or 0) // int(heads)
    if not (isinstance(layers, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)):
        return 0
    return 2 * layers * kv_heads * head_dim * lm.dtype.itemsize * max(tokens, 0)


def score(rows: torch.Tensor, head: Head | None, targets: Sequence[int], k: int,
          allowed: torch.Tensor | None, chunk: int) -> list[TokenLogprob]:
    """Log-probabilities of `targets`, the i-th predicted by `rows[i]`, `chunk` positions at a time.

    `rows` [positions, hidden]: final hidden states that `head` turns into logits; with `head`
    None, `rows` [positions, vocab] are the logits already.
    """
    out: list[TokenLogprob] = []
    for start in range(0, len(targets), max(1, chunk)):
        part = rows[start: start + chunk]
        logits = (part if head is None else head(part[None])[0]).float()
        if allowed is not None:
            logits = logits.masked_fill(~allowed[: logits.shape[-1]], float("-inf"))
        out += token_logprobs(logits, targets[start: start + chunk], k)
    return out


@contextmanager
def states_into(module: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """While open, the model's forward hands its head the last position only: the list receives
    the hidden states of every position the head was given."""
    captured: list[torch.Tensor] = []

    def last_only(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        states = args[0]
        captured.append(states)
        return (states[:, -1:], *args[1:])

    handle = module.register_forward_pre_hook(last_only)
    try:
        yield captured
    finally:
        handle.remove()


def split_head(lm: LoadedModel) -> tuple[Head | None, str]:
    """The head a scored prefill's states go through, a chunk at a time, or None and why not.

    The lean pass ends with norm and head, and hands out the normed states. A model's own forward is
    probed once on a few tokens: its head must run once, over every position, and its output must
    be the forward's logits exactly.
    """
    if lm.lean is not None:
        return lm.lean.head, "lean forward"
    model = lm.model
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    if not isinstance(head, torch.nn.Module):
        return None, "the model has no output embeddings module"
    ids = lm.codec.encode("scoring probe")[:8] or [0]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(_module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        seen.append((args[0], output))

    extra = {"logits_to_keep": 0} if "logits_to_keep" in lm.forward_extra else {}
    handle = head.register_forward_hook(record)
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids], dtype=torch.long, device=lm.device), **extra)
    except Exception as exc:  # an unusual model: it keeps computing its logits whole
        return None, f"the probe failed: {str(exc)[:120]}"
    finally:
        handle.remove()
    if len(seen) != 1:
        return None, f"the head ran {len(seen)} times in one forward"
    states, logits = seen[0]
    if not isinstance(logits, torch.Tensor) or tuple(states.shape[:2]) != (1, len(ids)):
        return None, "the head is not given every position's states"
    if tuple(logits.shape) != tuple(out.logits.shape) or not torch.equal(logits.float(), out.logits.float()):
        return None, "the forward changes the head's logits (soft-capping or scaling)"
    return head, "the model's head (probed)"


def resolve(lm: LoadedModel) -> Head | None:
    """`split_head`, logged once: the decision that bounds every scored prompt's logits. Never
    raises: the loop thread asks as it starts, and an odd model only keeps its logits whole."""
    try:
        head, why = split_head(lm)
    except Exception as exc:
        head, why = None, f"the head could not be examined: {str(exc)[:120]}"
    log.info("prompt_scoring", chunked=head is not None, chunk_positions=chunk_positions(lm.vocab_size),
             why=why)
    return head
