"""CPU products straight on GGUF weights: blocks repacked at load (layout), numba kernels (kernels), threads
over rows (products), and the weight the NumPy backend holds (weights)."""
