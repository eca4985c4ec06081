"""ddl-wgpu: train and heal transformer language models on any Vulkan, Metal or DX12 GPU (docs/architecture.md).

One folder per layer, each importing only the layers below it (tests/test_import_graph.py holds the rule):

    cli/      the `ddl-wgpu` commands: options in, one-line errors out, what is printed
    jobs/     what a run is: train, sweeps, heal, accept, generate, compress, their checkpoints and reports
    engine/   the model on the GPU (nets, works, the frozen trunk, the decoder) and its numpy twin (refnet)
    ops/      one kernel launcher per WGSL family (shaders/); ops/codegen/ the hot kernels' code generators
    runtime/  the WebGPU device: adapter, kernels, buffers, submits, read-back
    files/    the .ddlw container, models on disk, Hugging Face folders (files/hf/)

Three modules stay at the top, each a layer of one file:
    backend.py  the seam between the jobs and the two engines: which backend a command runs on, and the
                protocols both engines satisfy (imports engine/ lazily, so the numpy path never loads wgpu)
    data.py     data specs into token windows (text, jsonl, token files, the embedded stdlib corpus);
                only the jobs and the CLI read data
    errors.py   `UserError`, the base of every error a user can cause, which every layer raises
"""
