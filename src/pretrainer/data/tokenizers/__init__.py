"""Tokenizers: a shared base, tiktoken BPEs, Hugging Face tokenizer.json, the chat format."""
