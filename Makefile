# `make demo` and `make test` create .venv on first use and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CUDA builds of these releases; pip takes them from the local wheel store where it has one.
TORCH := torch==2.14.1 torchvision==0.29.1
NPROC ?= 2
TEST_WORKERS ?= 2
# recipe:small-images (src/ddptrain/recipes/small-images.toml), its EMA included.
DEMO_FLAGS ?= --config recipe:small-images --epochs 12 -b 128 --seed 0 \
	-j 1 -p 20 --out-dir runs/demo

.PHONY: demo test lint format clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev,onnx]'
	touch $(STAMP)

# 2-process DDP on the built-in dataset: gloo on CPU, NCCL on CUDA (chosen by ddptrain).
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/torchrun --standalone --nproc-per-node $(NPROC) -m ddptrain train $(DEMO_FLAGS)

# Two tests at a time: a test's processes spend most of their time importing torch on one core,
# which left the second core idle: on 2 cores .ci/run takes about 0.6 of its CPU time in wall
# time so, 0.87 one test at a time (README, Two commands).
# The serial ones (timed, or needing the machine to themselves) run after, alone.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not serial"; \
	parallel=$$?; OMP_NUM_THREADS=1 $(BIN)/pytest -q -m serial && exit $$parallel

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

format: $(STAMP)
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

clean:
	rm -rf $(VENV) runs
