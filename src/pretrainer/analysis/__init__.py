"""Reads run dirs and configs: plan, flops, serve-cost, reports, scaling laws."""
