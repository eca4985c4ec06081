"""`python -m ddl_wgpu.cli`: the same entry point as the `ddl-wgpu` script."""

from ddl_wgpu.cli import main

main()
