"""Evaluation: takes a model, a tokenizer and data; never the training loop's insides."""
