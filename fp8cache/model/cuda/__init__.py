"""The CUDA (and ROCm) backend's Python side: decode steps captured as CUDA graphs, and the kernels' error flag
read once per step instead of after every op."""
