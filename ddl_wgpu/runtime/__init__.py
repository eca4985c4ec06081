"""The WebGPU device layer: adapter, kernels compiled once, buffers, recorded passes, submits and read-back
(gpu.py), its errors, the WGSL sources it compiles (shader_files), the decoder's read-back buffer (readback)
the smoke-test kernel (selftest), and the one reader of sizes in bytes every size option and variable goes
through (sizes). Knows nothing of models; imports only errors.
"""
