"""The bottom layer: errors and exit codes, atomic files and hashes, device and dtype, the GPU table."""
