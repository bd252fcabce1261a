"""The CPU fast paths of the torch backend: oneDNN projections and attention, the flash-kernel chunk
attention, decode attention by context length, the packed prefill scan, and the compiled Mamba
decode step. Each keeps a plain path as its oracle (see each module)."""
