"""Corpus sources, tokenizers, token-file preparation and the training data loader."""
