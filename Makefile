# The two commands of the README. Each bootstraps .venv and a Vulkan driver itself (scripts/bootstrap.sh).
.PHONY: demo test test-gpu test-blas lint bench clean

# lavapipe uses every core by default; two threads keep timings stable on CI-sized machines (docs/wgpu-notes.md)
export LP_NUM_THREADS ?= 2
export PYTHONUNBUFFERED = 1
# The numpy backend's products at the demo and test shapes are too small to share between threads: on this
# 2-core machine one OpenBLAS thread ran a tiny --mtp step 10x faster than two when another process was busy
# (two threads spin-wait on each other).
export OPENBLAS_NUM_THREADS ?= 1

# The main job on the embedded corpus: a baseline vs DDL sweep on Python's stdlib sources, the ranked table,
# report and plots under runs/demo/; then the heal story (scripts/heal_story.sh): train --mtp, compress, accept
# (drops), heal, accept (recovers), generate, under runs/demo/heal/; then the same on a Qwen3.5-family hybrid
# (scripts/heal_story_hybrid.sh, runs/demo/heal-hybrid/). What it prints and how long it takes: docs/demo.md.
DEMO_ARGS ?= --data stdlib --variants baseline,ddl,ddl-cc --preset tiny --max-steps 60 --eval-interval 20 \
	--eval-batches 4 --batch-size 8 --seq-len 128 --learning-rate 3e-3 --warmup-steps 5 --max-tokens 2000000

# Run a second time on the other WebGPU runtime, Dawn (DDL_WGPU_RUNTIME=dawn: Tint compiles every shader, where
# the first pass's wgpu-native uses naga; docs/runtimes.md), within WebGPU's default limits instead of the
# adapter's (DDL_WGPU_LIMITS=webgpu: every kernel has a path within them, docs/wgpu-notes.md). The files that check
# every entry point (tests/test_entry_points.py names them) and the engine's; the jobs built on them (heal, accept,
# the streamed trunk) read only the buffer-size limits, which the tests' shapes never reach, and call the runtime
# only through the device layer these tests cover, so they run once (CI's whole `make test` must stay under
# 15 minutes). Where Dawn cannot start (no Mesa it accepts), the second pass skips its tests, saying why.
PORTABLE_TESTS = tests/test_engine*.py tests/test_kernel_*.py tests/test_chain_attention.py tests/test_gpu.py \
	tests/test_entry_points.py tests/test_generate_gpu*.py

# BOOTSTRAP and DDL let a host without network run the same targets on its own Python (BENCHMARKS.md: on the
# H200, `make demo BOOTSTRAP=true DDL="python3 -m ddl_wgpu.cli"`).
BOOTSTRAP ?= scripts/bootstrap.sh
DDL ?= .venv/bin/ddl-wgpu

demo:
	@EXTRAS=plot $(BOOTSTRAP)
	$(DDL) devices
	rm -rf runs/demo
	$(DDL) train $(DEMO_ARGS) --out runs/demo
	@echo; echo "== the heal story: train --mtp, compress, accept (drops), heal, accept (recovers)"
	scripts/heal_story.sh "$(DDL)" runs/demo/heal
	@echo; echo "== the heal story on a hybrid (Qwen3.5-family) model: train --arch qwen3_5 --mtp, compress, accept (drops), heal, accept (recovers)"
	scripts/heal_story_hybrid.sh "$(DDL)" runs/demo/heal-hybrid
	@echo; echo "outputs: runs/demo/report.json (ranked sweep), runs/demo/*.png (plots), runs/demo/VARIANT/ (reports, checkpoints), runs/demo/heal/ (the heal story), runs/demo/heal-hybrid/ (on a hybrid)"

test:
	@EXTRAS=test,plot,hf scripts/bootstrap.sh
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest
	@echo; echo "== the engine and kernel tests again on Dawn (Tint) within WebGPU's default limits (what every Metal, DX12 and Vulkan GPU meets)"
	DDL_WGPU_RUNTIME=dawn DDL_WGPU_LIMITS=webgpu .venv/bin/python -m pytest -p no:cacheprovider $(PORTABLE_TESTS)

# The tests that need a GPU's matrix units (Dawn's subgroup matrices: tensor cores): they skip, with the reason,
# where no configuration exists, so run them on such a GPU (BENCHMARKS.md, "The matrix units through Dawn").
# PYTEST lets a host without the .venv run them (on the GPU machine: `make test-gpu PYTEST="python3 -m pytest"`).
PYTEST ?= .venv/bin/python -m pytest
test-gpu:
	DDL_WGPU_RUNTIME=dawn $(PYTEST) -q -rs -p no:cacheprovider tests/test_kernel_matmul_tc.py tests/test_runtimes.py

# The float64 gradient checks under every OpenBLAS kernel this CPU runs (not part of `make test`: ~3 min each)
test-blas:
	@EXTRAS=test,plot,hf scripts/bootstrap.sh
	scripts/test_blas.sh

lint:
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

# Benchmarks need a real GPU (BENCHMARKS.md); PyTorch, when installed, is measured in the same run.
bench:
	@EXTRAS= $(BOOTSTRAP)
	.venv/bin/python bench/kernels.py
	.venv/bin/python bench/train_step.py

clean:
	rm -rf .venv .pytest_cache .ruff_cache dist build runs
