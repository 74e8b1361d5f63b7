"""Model loading: the built-in small causal LM (no download) or any local Hugging Face directory."""

from __future__ import annotations

import codecs
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from gpu_watchdog.inference.lean import LeanForward, lean_forward

BUILTIN_NAME = "gpu-watchdog-builtin-tiny"
_BUILTIN_SEED = 1234
_PRINTABLE = range(32, 127)


class NoChatTemplate(ValueError):
    """The model's tokenizer has no chat template."""


class Codec(Protocol):
    """The part of a tokenizer the engine and the API need."""

    pad_id: int
    eos_id: int | None
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt of a conversation, through the model's chat template, ready for the answer."""
        ...

    def decoder(self, skip_special_tokens: bool = True) -> StreamDecoder: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The vocabulary's own spelling of each id (BPE pieces, byte markers and all)."""
        ...


class StreamDecoder(Protocol):
    def feed(self, token_ids: list[int]) -> str: ...


class ByteCodec:
    """Byte-level tokenizer: token i is byte i; 256 is padding, 257 beginning of text."""

    pad_id = 256
    bos_id = 257
    eos_id: int | None = None
    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.bos_id, *text.encode("utf-8")] if add_special_tokens else list(text.encode("utf-8"))

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The same plain template as the generated benchmark models: "role: content" lines.
        lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.encode(lines + "assistant: ")

    def decoder(self, skip_special_tokens: bool = True) -> _ByteDecoder:
        return _ByteDecoder()

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_strs(self, token_ids: list[int]) -> list[str]:
        return [self.decode([t]) for t in token_ids]


class _ByteDecoder:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: list[int]) -> str:
        return self._dec.decode(bytes(t for t in token_ids if t < 256))


class HFCodec:
    """Wraps a Hugging Face tokenizer; decodes incrementally so streamed text is never split mid-character."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.pad_id: int = int(pad)
        self.eos_id: int | None = tokenizer.eos_token_id
        self.vocab_size: int = len(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        return ids

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise NoChatTemplate("this model's tokenizer has no chat template: use /v1/completions")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes its own special tokens (BOS and the like); adding them again would
        # double them, as vLLM's chat route also avoids.
        ids: list[int] = self._tok(text, add_special_tokens=False)["input_ids"]
        return ids

    def decoder(self, skip_special_tokens: bool = True) -> _HFDecoder:
        return _HFDecoder(self._tok, skip_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def token_strs(self, token_ids: list[int]) -> list[str]:
        return [str(t) for t in self._tok.convert_ids_to_tokens(token_ids)]


class _HFDecoder:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._emitted = ""

    def feed(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        text: str = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        new = text[len(self._emitted):]
        self._emitted = text
        return new


@dataclass
class LoadedModel:
    name: str
    model: Any
    codec: Codec
    device: torch.device
    dtype: torch.dtype
    context_len: int
    # Token ids the built-in model may emit (printable ASCII): random weights would otherwise
    # produce control bytes. None for real models.
    allowed_tokens: torch.Tensor | None
    # Extra forward() arguments; see `last_logits_only`.
    forward_extra: dict[str, Any] = field(default_factory=dict)
    # The forward() keyword of the KV cache; see `cache_keyword`.
    cache_kwarg: str = "past_key_values"
    # The decode loop's forward pass where the architecture allows (`inference.lean`), else None:
    # the model's own forward; `forward_path` says which and, if not lean, why.
    lean: LeanForward | None = None
    forward_path: str = "transformers"

    @property
    def vocab_size(self) -> int:
        """Token ids the model takes (its embedding rows; may exceed the tokenizer's vocabulary)."""
        config = getattr(self.model, "config", None)
        return int(getattr(config, "vocab_size", None) or self.codec.vocab_size)


def _forward_path(model: Any, lean_pass: bool) -> dict[str, Any]:
    if not lean_pass:
        return {"lean": None, "forward_path": "transformers (asked for)"}
    lean, why = lean_forward(model)
    return {"lean": lean, "forward_path": "lean" if lean is not None else f"transformers ({why})"}


def last_logits_only(model: Any) -> dict[str, Any]:
    """Ask for the last position's logits only, where the model supports it.

    Generation reads nothing else, and the full [batch, prompt, vocab] tensor is the largest
    activation of a long prefill (2048 tokens x 32000 vocab in bf16 = 125 MiB per sequence):
    memory that would otherwise count against the admission budget for nothing.
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def cache_keyword(model: Any) -> str:
    """The KV cache's forward() keyword: `cache` from transformers 5.2x, `past_key_values` before.

    Passing the wrong one is silent (it lands in **kwargs): every step would then see only its
    new token without the cache, and generate garbage. The GPU machines run transformers 5.17.
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def pick_device(requested: str) -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but no CUDA device is available")
        return torch.device("cuda")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device) -> torch.dtype:
    """Half precision on GPUs (bf16 only where the card supports it), fp32 on CPU."""
    if device.type != "cuda":
        return torch.float32
    if torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


def builtin_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    settings: dict[str, Any] = dict(
        vocab_size=ByteCodec.vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=1024,
        pad_token_id=ByteCodec.pad_id,
        bos_token_id=ByteCodec.bos_id,
        eos_token_id=None,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def load_builtin(device: torch.device, lean: bool = True, **config_overrides: Any) -> LoadedModel:
    from transformers import LlamaForCausalLM

    config = builtin_config(**config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_BUILTIN_SEED)
        model: Any = LlamaForCausalLM(config)
    dtype = pick_dtype(device)
    model = model.to(device=device, dtype=dtype).eval()
    allowed = torch.zeros(config.vocab_size, dtype=torch.bool, device=device)
    allowed[list(_PRINTABLE)] = True
    return LoadedModel(
        name=BUILTIN_NAME,
        model=model,
        codec=ByteCodec(),
        device=device,
        dtype=dtype,
        context_len=int(config.max_position_embeddings),
        allowed_tokens=allowed,
        forward_extra=last_logits_only(model),
        cache_kwarg=cache_keyword(model),
        **_forward_path(model, lean),
    )


def load_pretrained(path: str, device: torch.device, lean: bool = True) -> LoadedModel:
    """Load a local Hugging Face causal-LM directory; never reaches out to a hub."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"--model {path}: not a directory")
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"--model {path}: no config.json (expected a Hugging Face model directory)")
    dtype = pick_dtype(device)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    model = model.to(device).eval()
    ctx: Any = getattr(model.config, "max_position_embeddings", None) or getattr(tokenizer, "model_max_length", 2048)
    return LoadedModel(
        name=directory.name,
        model=model,
        codec=HFCodec(tokenizer),
        device=device,
        dtype=dtype,
        context_len=int(min(int(ctx), 1 << 20)),
        allowed_tokens=None,
        forward_extra=last_logits_only(model),
        cache_kwarg=cache_keyword(model),
        **_forward_path(model, lean),
    )


def load(path: str | None, device: torch.device) -> LoadedModel:
    return load_builtin(device) if path is None else load_pretrained(path, device)


def greedy_without_cache(lm: LoadedModel, prompt: str, max_tokens: int) -> list[int]:
    """The reference the engine's cached decoding must match: every step recomputes the whole
    sequence. Slow; for checks only (tests, the GPU check on another transformers release)."""
    ids = lm.codec.encode(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = lm.model(input_ids=torch.tensor([ids + out], device=lm.device)).logits[0, -1].float()
            if lm.allowed_tokens is not None:
                logits = logits.masked_fill(~lm.allowed_tokens[: logits.shape[-1]], float("-inf"))
            out.append(int(logits.argmax()))
    return out
