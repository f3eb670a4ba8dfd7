"""The run-dir contract: checkpoint format, saved configs, metrics files, HF format, run loading."""
