"""Typed configs: the schema, loading (TOML + dotted overrides), resolution, suggestions, preflight."""
