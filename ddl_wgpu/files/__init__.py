"""Everything on disk: the .ddlw container (container, container_format, container_read; docs/container.md),
models read and written tensor by tensor (modelfile, lazy), safe paths and atomic writes (safeio), the host
memory budget of heal's spill file (hostmem), `inspect`, and Hugging Face folders (hf/). Imports only ddl_ref
and errors: reading a file never needs a GPU.
"""
