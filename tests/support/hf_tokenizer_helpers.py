"""Helpers shared by the tests split from test_hf_tokenizer.py."""

from pathlib import Path

import numpy as np
from helpers import DOCS
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pretrainer.data.data_dir import open_data_dir

TEXTS = [
    "Hello world",
    "def main(argv):\n\treturn 0\n",
    "naïve café — 日本語 🙂",
    "   spaces   \n\n\n  x",
    "1234567 + 89",
]


def byte_level_bpe(directory: Path, bos: bool = True, vocab_size: int = 400) -> Path:
    """A Llama-3-like tokenizer.json: byte-level BPE, <|begin_of_text|> put first by the post-processor."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(
        DOCS + TEXTS,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def documents_of(data_dir: Path, split: str) -> list[list[int]]:
    """The split's token ids cut after each end-of-text."""
    data = open_data_dir(data_dir)
    tokens = np.asarray(data.tokens(split)).tolist()
    docs, start = [], 0
    for i, t in enumerate(tokens):
        if t == data.eot_id:
            docs.append(tokens[start : i + 1])
            start = i + 1
    assert start == len(tokens)
    return docs
