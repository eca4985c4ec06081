"""Hugging Face folders in and out, tensor by tensor (docs/commands.md): convert (import-hf / export-hf),
folder (config.json, safetensors shards and their index), common (the name maps both families share), llama
and qwen35 (each family's layout), keep (the small files a folder carries along), served_draft and
draft_layout (the shapes and conventions the serving runtimes give an MTP draft).
"""
