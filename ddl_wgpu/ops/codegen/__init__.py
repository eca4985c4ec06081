"""Code generators of the hot kernels, beside the launchers that use them (ops/ holds one launcher per WGSL
family; these are not families): wgsl_tiles (register tiles of small products as straight-line WGSL) and
gdn_plan (the chunked gated delta rule's plan, its workgroup-memory layouts and generated products)."""
