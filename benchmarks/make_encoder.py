"""Write a local Hugging Face encoder directory with random weights: no download, any size.

Usage: python -m gpu_watchdog.benchmarks.make_encoder DIR [--arch bert|roberta|xlm-roberta] [--task embed|classify]
       [--pooling cls|mean|max|last] [--hidden 64 --layers 2 --heads 4]

The tokenizer is built with the `tokenizers` library in the architecture's own style (WordPiece
for BERT, byte-level BPE for RoBERTa, Unigram for XLM-R), so the directory loads with
AutoTokenizer/AutoModel, `gpu-watchdog serve --handler embeddings|classifier --model DIR` and
vLLM's pooling runner. `--pooling` writes a sentence-transformers pooling config (modules.json,
1_Pooling/config.json, Normalize); without it the directory has none.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ARCHS = ("bert", "roberta", "xlm-roberta")
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
_WORDS = ("the gpu model server request batch token memory cache queue health probe canary watchdog"
          " embedding vector classify label ping hello world fast slow good bad ok yes no").split()


def build_tokenizer(arch: str, context: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if arch == "bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        chars = sorted({c for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"})
        vocab = {t: i for i, t in enumerate([*specials, *chars, *(f"##{c}" for c in chars), *_WORDS])}
        tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        cls, sep, pad, unk, mask = specials[2], specials[3], specials[0], specials[1], specials[4]
    elif arch == "roberta":
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        vocab = {t: i for i, t in enumerate(specials)}
        for ch in pre_tokenizers.ByteLevel.alphabet():
            vocab[ch] = len(vocab)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        cls, sep, pad, unk, mask = "<s>", "</s>", "<pad>", "<unk>", "<mask>"
    else:
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        pieces = [(s, 0.0) for s in specials]
        pieces += [(f"\u2581{w}", -2.0) for w in _WORDS]
        pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-\u2581"]
        tok = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        cls, sep, pad, unk, mask = "<s>", "</s>", "<pad>", "<unk>", "<mask>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B {sep}",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, cls_token=cls, sep_token=sep, pad_token=pad,
                                   unk_token=unk, mask_token=mask, bos_token=cls, eos_token=sep,
                                   model_max_length=context)


def make(directory: Path, arch: str = "bert", task: str = "embed", pooling: str | None = None, hidden: int = 64,
         layers: int = 2, heads: int = 4, context: int = 512, seed: int = 0) -> Path:
    import torch
    from transformers import (
        AutoModel,
        AutoModelForSequenceClassification,
        BertConfig,
        RobertaConfig,
        XLMRobertaConfig,
    )

    tokenizer = build_tokenizer(arch, context)
    common: dict[str, Any] = dict(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, intermediate_size=hidden * 2,
                                  pad_token_id=tokenizer.pad_token_id)
    if task == "classify":
        common.update(num_labels=len(LABELS), id2label=dict(LABELS), label2id={v: k for k, v in LABELS.items()})
    if arch == "bert":
        config: Any = BertConfig(max_position_embeddings=context, **common)
    else:
        kind = RobertaConfig if arch == "roberta" else XLMRobertaConfig
        # Position ids start after the padding id: two more positions than inputs.
        config = kind(max_position_embeddings=context + 2, bos_token_id=tokenizer.cls_token_id,
                      eos_token_id=tokenizer.sep_token_id, **common)
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if task == "classify" else AutoModel
    model: Any = auto.from_config(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if pooling is not None:
        write_pooling(directory, pooling, hidden)
    return directory


def write_pooling(directory: Path, mode: str, dimension: int, normalize: bool = True) -> None:
    """A sentence-transformers module list: Transformer, Pooling(mode), Normalize."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
            "last": "pooling_mode_lasttoken"}
    config: dict[str, Any] = {"word_embedding_dimension": dimension, **{k: False for k in keys.values()},
                              "pooling_mode_mean_sqrt_len_tokens": False}
    config[keys[mode]] = True
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory")
    p.add_argument("--arch", choices=ARCHS, default="bert")
    p.add_argument("--task", choices=("embed", "classify"), default="embed")
    p.add_argument("--pooling", choices=("cls", "mean", "max", "last"), default=None)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    make(Path(a.directory), a.arch, a.task, a.pooling, a.hidden, a.layers, a.heads, a.context, a.seed)
    print(a.directory)


if __name__ == "__main__":
    main()
