"""The CUDA backend: Triton kernels for paged attention and the Mamba2 mixer (attention.py,
mamba.py), and the ops object the layers call when it is attached (ops.py). Importing this package
does not import Triton."""
