"""Hybrid (Mamba2 + attention) models of several Hugging Face families: the family-neutral config, the
shared blocks, the architecture adapters (`families/`) and the checkpoint loader."""
