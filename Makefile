# The two commands of the README. Each bootstraps .venv and a Vulkan driver itself (scripts/bootstrap.sh).
.PHONY: demo test lint bench clean

# lavapipe uses every core by default; two threads keep timings stable on CI-sized machines (wgpu.md §1)
export LP_NUM_THREADS ?= 2
export PYTHONUNBUFFERED = 1

demo:
	@EXTRAS=test,plot scripts/bootstrap.sh
	.venv/bin/ddl-wgpu demo

test:
	@EXTRAS=test,plot scripts/bootstrap.sh
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest

lint:
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

bench:
	@EXTRAS=test scripts/bootstrap.sh
	.venv/bin/python bench/kernels.py

clean:
	rm -rf .venv .pytest_cache .ruff_cache dist build
