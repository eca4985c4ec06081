"""Kernel launchers: one module per WGSL family (`shaders/<family>.wgsl`), forward above backward.

Every launcher takes the GPU, then outputs, then inputs (llm.c's order), then sizes, and returns a
`gpu.Call`: bind groups and uniforms built once, recorded into a step as many times as needed. A buffer
argument is either a `wgpu` buffer or a `(buffer, byte_offset, nbytes)` view into a flat arena.
"""
