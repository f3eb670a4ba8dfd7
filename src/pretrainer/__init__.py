"""pretrainer: pretrain decoder-only language models from scratch, reproducibly and within a budget."""

__version__ = "0.1.0"

# A target with this id does not count in the loss: outside a chat loss mask, padding, a document's
# first token under document packing. data/ writes it, model/ skips it; here so neither imports the other.
IGNORE_INDEX = -1
