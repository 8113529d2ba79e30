"""Rows to examples: datasets, prompts, preference pairs, SFT rows, the built-in tasks."""
