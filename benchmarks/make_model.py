"""Write a local Hugging Face causal-LM directory with random weights: no download, any size.

Usage: python -m gpu_watchdog.benchmarks.make_model DIR [--hidden 2048 --layers 24 --heads 16 --vocab 32000]

The tokenizer is byte-level (each UTF-8 byte one token), built with the `tokenizers` library,
so the directory loads with AutoTokenizer/AutoModelForCausalLM and `gpu-watchdog serve --model DIR`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer(vocab_size: int) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = {tok: i for i, tok in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    specials = ["<pad>", "<s>", "</s>"]
    for s in specials:
        byte_vocab[s] = len(byte_vocab)
    if len(byte_vocab) > vocab_size:
        raise SystemExit(f"--vocab must be at least {len(byte_vocab)}")
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A plain chat template, so that chat endpoints (vLLM's, ours) serve the model too.
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE)


def make(directory: Path, hidden: int, layers: int, heads: int, vocab: int, context: int, seed: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(vocab)
    ids = tokenizer.convert_tokens_to_ids(["<pad>", "<s>", "</s>"])  # type: ignore[attr-defined]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=context, pad_token_id=ids[0], bos_token_id=ids[1],
                         eos_token_id=ids[2], tie_word_embeddings=False, initializer_range=0.02)
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)  # type: ignore[attr-defined]
    params = sum(p.numel() for p in model.parameters())
    print(f"{directory}: {params / 1e9:.2f} B parameters, {params * 2 / 2**30:.2f} GiB in bf16")
    return directory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    make(Path(a.directory), a.hidden, a.layers, a.heads, a.vocab, a.context, a.seed)


if __name__ == "__main__":
    main()
