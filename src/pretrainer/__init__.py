"""pretrainer: pretrain decoder-only language models from scratch, reproducibly and within a budget."""

__version__ = "0.1.0"
