# The two commands of the README. Each bootstraps .venv and a Vulkan driver itself (scripts/bootstrap.sh).
.PHONY: demo test lint bench clean

# lavapipe uses every core by default; two threads keep timings stable on CI-sized machines (wgpu.md §1)
export LP_NUM_THREADS ?= 2
export PYTHONUNBUFFERED = 1

# The main job on the embedded corpus: a baseline vs DDL sweep on Python's stdlib sources (~2-4 min on
# lavapipe), then the ranked table, report and plots under runs/demo/.
DEMO_ARGS ?= --data stdlib --variants baseline,ddl,ddl-cc --preset tiny --max-steps 60 --eval-interval 20 \
	--eval-batches 4 --batch-size 8 --seq-len 128 --learning-rate 3e-3 --warmup-steps 5 --max-tokens 2000000

# The heal story (mtp-heal.md), after the sweep, under runs/demo/heal/ (~2 min on lavapipe): train a tiny
# model with a jointly trained MTP draft (--mtp), compress it (drop its last block), measure the draft's
# greedy acceptance (it drops: the trunk changed under it), heal the draft on the compressed trunk's own
# predictions, measure again (it recovers). Acceptance per depth before/after is printed at the end.
HEAL_DIR ?= runs/demo/heal
HEAL_TRAIN_ARGS ?= --data stdlib --variants baseline --preset tiny --mtp --mtp-weight 0.3 --max-steps 150 \
	--eval-interval 50 --eval-batches 4 --batch-size 8 --seq-len 128 --learning-rate 3e-3 --warmup-steps 10 \
	--max-tokens 400000 --no-plots
HEAL_ARGS ?= --data stdlib --tokens 40000 --lr 1e-3 --eval-every 50 --refresh 50
ACCEPT_ARGS ?= --data stdlib --depth 3 --tokens 20000
TRAINED = $(HEAL_DIR)/train/baseline/checkpoint.ddlw

demo:
	@EXTRAS=test,plot scripts/bootstrap.sh
	.venv/bin/ddl-wgpu devices
	.venv/bin/ddl-wgpu check
	.venv/bin/ddl-wgpu train $(DEMO_ARGS) --out runs/demo
	@echo; echo "== the heal story: train --mtp, compress, accept (drops), heal, accept (recovers)"
	.venv/bin/ddl-wgpu train $(HEAL_TRAIN_ARGS) --out $(HEAL_DIR)/train
	.venv/bin/ddl-wgpu compress $(TRAINED) --drop-layers 1 --out $(HEAL_DIR)/compressed.ddlw
	.venv/bin/ddl-wgpu accept $(TRAINED) $(ACCEPT_ARGS) --json > $(HEAL_DIR)/accept_trained.json
	.venv/bin/ddl-wgpu accept $(HEAL_DIR)/compressed.ddlw $(ACCEPT_ARGS) --json > $(HEAL_DIR)/accept_compressed.json
	.venv/bin/ddl-wgpu heal $(HEAL_DIR)/compressed.ddlw --init $(TRAINED) $(HEAL_ARGS) --out $(HEAL_DIR)/healed.ddlw
	.venv/bin/ddl-wgpu accept $(HEAL_DIR)/healed.ddlw $(ACCEPT_ARGS) --json > $(HEAL_DIR)/accept_healed.json
	@echo; echo "greedy acceptance of the draft chained 3 deep, prefix A_j per depth (mtp-heal.md §5):"
	@.venv/bin/python -m ddl_wgpu.accept trained=$(HEAL_DIR)/accept_trained.json \
		compressed=$(HEAL_DIR)/accept_compressed.json healed=$(HEAL_DIR)/accept_healed.json
