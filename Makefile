# gasloc — the two commands a new user types are `make demo` and `make test`.
# Everything they need is installed here, idempotently: a .venv with the PyPI torch wheel
# (libtorch for tch), transformers for the parity test, and the demo data.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV    := $(CURDIR)/.venv
PYTHON  := $(VENV)/bin/python
DATA    := $(CURDIR)/datasets
TORCH_VERSION := 2.11.0

# tch's build script (and node/build.rs, for the rpath) find torch through LIBTORCH, set in
# .cargo/config.toml to .venv/torch: a link to the wheel's torch package, made by `venv`.
# So a plain `cargo build` or `cargo test` works in a checkout where `make setup` ran.
export PATH := $(VENV)/bin:$(PATH)
export GASLOC_PYTHON := $(PYTHON)

NODE := target/debug/gasloc-node

.PHONY: help setup venv chromium nettools imagetools build demo-data demo test image bench fuzz clean

help:
	@echo "make demo   set up, build, and run a local swarm (bootstrap + 4 nodes) on Shakespeare"
	@echo "make test   set up, then formatting, clippy (warnings denied) and every test"
	@echo "make setup  the .venv with torch $(TORCH_VERSION) + transformers, and the demo data"
	@echo "make image  the container image for deploy/compose.yaml (docker-compose; see README)"
	@echo "make bench  the benchmarks in bench/ (see docs/performance.md)"
	@echo "make fuzz   each fuzz target for FUZZ_TIME seconds (default 30; see docs/fuzzing.md)"

setup: venv chromium nettools imagetools demo-data

# Debian's Chromium, for the dashboard test (headless).
chromium:
	@command -v chromium >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
		else sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null; fi; }

# iproute2 and iptables, for the tests that build networks in namespaces (root only: they
# need root to run at all, and print "not run" without it).
nettools:
	@if [ "$$(id -u)" = 0 ]; then \
		command -v ip >/dev/null && command -v iptables >/dev/null || { \
			apt-get update -qq && apt-get install -y -qq iproute2 iptables >/dev/null; }; \
	fi

# patchelf, for the container image (deploy/docker/build-image.sh): it takes libtorch_cuda.so
# out of the staged binaries' needed libraries (CUDA is not in the image).
imagetools:
	@command -v patchelf >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq patchelf >/dev/null; \
		else sudo apt-get update -qq && sudo apt-get install -y -qq patchelf >/dev/null; fi; }

venv: $(VENV)/.ready $(VENV)/torch

$(VENV)/.ready:
	@command -v python3 >/dev/null || { echo "python3 is needed (3.10+)"; exit 1; }
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check \
		"torch==$(TORCH_VERSION)" numpy transformers safetensors
	$(PYTHON) -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

# The link LIBTORCH names (.cargo/config.toml).
$(VENV)/torch: $(VENV)/.ready
	ln -sfn "$$($(PYTHON) -c 'import os, torch; print(os.path.dirname(torch.__file__))')" $@

build: venv
	cargo build --workspace

demo-data: build
	bash deploy/demo-data.sh $(NODE) $(DATA)

demo: setup
	bash deploy/demo.sh target/debug $(DATA)

# Every test, in two lanes at once: the swarm tests of `tests/` (whole processes and
# containers, most of their time spent waiting on wall-clock rounds) beside the other
# packages' tests, each lane one `cargo test`. The swarm lane's output goes to
# target/test-swarms.log and is printed when both lanes are done; either failing fails.
test: setup
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo test --workspace --no-run
	cargo test -p gasloc-tests --no-run
	@cargo test --no-fail-fast -p gasloc-tests > target/test-swarms.log 2>&1 & swarms=$$!; \
	others=0; cargo test --no-fail-fast --workspace --exclude gasloc-tests || others=$$?; \
	swarm=0; wait $$swarms || swarm=$$?; \
	echo "=== cargo test -p gasloc-tests (run beside the tests above) ==="; \
	cat target/test-swarms.log; \
	if [ $$others != 0 ] || [ $$swarm != 0 ]; then \
		echo "make test: FAILED (other packages: exit $$others; swarm tests: exit $$swarm)"; exit 1; \
	fi

# The container image (FROM scratch, nothing pulled; docs/operations.md), of the release
# binaries. Cached: rebuilt only when a binary, a library or the Dockerfile changed.
image: setup
	cargo build --release --workspace
	bash deploy/docker/build-image.sh target/release

bench: setup
	cargo build --release --workspace
	bash bench/train_throughput.sh
	bench/exchange_goodput $(if $(filter 0,$(shell id -u)),all,loopback)
	$(if $(filter 0,$(shell id -u)),bench/shard_fetch,@echo "bench/shard_fetch: skipped (network namespaces need root)")
	bench/control_plane_scale
	bench/round_scale
	bash bench/straggler.sh target/release $(DATA)/shakespeare-byte
	bash bench/overlap.sh target/release $(DATA)/shakespeare-byte
	$(if $(shell command -v nvidia-smi),bash bench/overlap_gpu.sh target/release $(DATA)/shakespeare-gpt2,@echo "bench/overlap_gpu: skipped (no GPU)")
	bash bench/gate_cost.sh target/release $(DATA)/shakespeare-byte

# The decoders that meet a stranger's bytes, under cargo-fuzz (nightly, libFuzzer), one
# after the other, FUZZ_TIME seconds each. New inputs go to fuzz/target/corpus/<target>
# (not committed); the committed corpus in fuzz/corpus/<target> seeds each run. A crash
# stops here and leaves its input in fuzz/artifacts/<target>/. docs/fuzzing.md.
FUZZ_TIME    ?= 30
FUZZ_TARGETS ?= exchange_frames control_message state_request manifest shard_header shard_request shard_response
FUZZ_FLAGS   ?= -rss_limit_mb=2048 -timeout=10
FUZZ := $(CURDIR)/fuzz
fuzz:
	@rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	@command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz
	cargo +nightly fuzz build -O -a
	for t in $(FUZZ_TARGETS); do \
		mkdir -p $(FUZZ)/target/corpus/$$t && \
		cargo +nightly fuzz run -O -a $$t $(FUZZ)/target/corpus/$$t $(FUZZ)/corpus/$$t -- \
			-max_total_time=$(FUZZ_TIME) $(FUZZ_FLAGS) \
			-max_len=$$(sed -n "s/^$$t //p" $(FUZZ)/max_len) -print_final_stats=1 || exit 1; \
	done

clean:
	cargo clean
	rm -rf $(DATA)
