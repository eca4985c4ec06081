"""The model as the GPU runs it, and its numpy twin (docs/architecture.md#the-layers).

net (parameters, gradients and moments in arenas laid out by layout.py), the works that record a job's
launches over shared blocks (blocks, gdn, vocab -> inference -> trunk; draft, heal_gpu), the frozen trunk
(stream: resident or streamed layer by layer), the decoder (decode, decode_cache), the memory plan (gpumem),
AdamW's settings (step) and the numpy backend (refnet). May import ops, runtime, files and errors.
"""
