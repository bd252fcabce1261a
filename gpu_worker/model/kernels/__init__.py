"""Triton kernels for the CUDA backend, and the hooks that route the model's primitive ops to them.

`reference.py` states every kernel's contract in plain torch (the oracle of the interpreter tests);
`attention.py` and `mamba.py` hold the kernels; `ops.py` is the backend object the model layers call
when it is attached (`attach_kernels`). Importing this package does not import Triton."""
