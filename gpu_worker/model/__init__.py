"""Hugging Face Bamba-format hybrid model: config parsing, the module tree, layers and the checkpoint loader."""
