"""Reports written from a run directory alone (never from training internals)."""
