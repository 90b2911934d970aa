# Two entry points (README): `make demo` and `make test`. Both build .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.base-installed
DEV := $(VENV)/.dev-installed
# torch 2.13.0 is the CPU build this machine kind keeps on disk; newer picks a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: demo test test-fast test-unit test-daemon test-engines test-host test-deploy test-gpu lint sanitize bench replay \
	observe proto clean

$(BASE): setup.cfg pyproject.toml setup.py tableserver/common/_take.c tableserver/common/bufcheck.h \
		tableserver/common/rowcopy.h tableserver/common/spin.h client/tableclient/graph/_flags.c \
		$(wildcard client/tableclient/graph/poller/_native_c/*.c client/tableclient/graph/poller/_native_c/*.h) \
		$(wildcard tableserver/disk/_diskio_c/*.c tableserver/disk/_diskio_c/*.h)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e .
	touch $@

# SGLang and vLLM (pinned) for the plugins' tests: --no-deps keeps their CUDA torch pins out (tests/requirements-engines.txt)
$(DEV): $(BASE) tests/requirements-engines.txt
	$(BIN)/python -m pip install -q "$(TORCH)" -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps -r tests/requirements-engines.txt
	touch $@

demo: $(BASE)
	$(BIN)/tableserver demo

# Every check CI runs (.ci/run), spread over the CPUs: the Soft-RoCE guest suite (GUEST_TEST, the longest
# single test) starts first, in a pytest of its own, and the sanitizer job beside it; lint, then the rest of
# the suite on TEST_WORKERS pytest-xdist workers, a file per worker at a time, files with slow tests first
# (tests/conftest.py), at a lower CPU priority than the guest (its emulated CPUs are the critical path). The
# guest's and the sanitizer's output follow the rest's; the exit status is the first failure's. The project's
# sources are byte-compiled first: an editable install is not (pip compiles what it installs), and every daemon,
# client and engine process the tests start would compile its imports again, the guest's under TCG, on a
# read-only root that keeps none (a stale .pyc is never used: Python checks each against its source).
TEST_WORKERS ?= 3
GUEST_TEST := tests/host/test_rdma_guest.py
GUEST_LOG := build/guest-test.log
SANITIZE_LOG := build/sanitize.log
test: $(DEV)
	@mkdir -p build; \
	$(BIN)/python -m compileall -q -j 0 tableserver client tests bench >/dev/null || exit 1; \
	$(BIN)/python -m pytest -p no:cacheprovider -q -rs $(GUEST_TEST) > $(GUEST_LOG) 2>&1 & guest=$$!; \
	nice -n 5 $(MAKE) --no-print-directory sanitize > $(SANITIZE_LOG) 2>&1 & sanitize=$$!; \
	trap 'kill $$guest $$sanitize 2>/dev/null' INT TERM; \
	nice -n 5 $(MAKE) --no-print-directory lint \
	&& nice -n 5 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --ignore=$(GUEST_TEST) $(PYTEST_ARGS); \
	rest=$$?; \
	wait $$sanitize; sanitize_rc=$$?; \
	echo "--- make sanitize (beside the rest):"; cat $(SANITIZE_LOG); \
	wait $$guest; guest_rc=$$?; \
	echo "--- $(GUEST_TEST) (started first, beside the rest):"; cat $(GUEST_LOG); \
	exit $$(( rest != 0 ? rest : sanitize_rc != 0 ? sanitize_rc : guest_rc ))

# One kind of tests (tests/<kind>/, the marker of the same name): make test-unit, test-daemon, ...
test-unit test-daemon test-engines test-host test-deploy test-gpu: $(DEV)
	$(BIN)/python -m pytest tests/$(@:test-%=%) $(PYTEST_ARGS)

# The house plan (import contracts in setup.cfg) and ruff's lint and format check over every Python file
lint: $(DEV)
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The four C extensions built with -fsanitize=address,undefined in a copy of the tree (build/sanitize: the
# in-tree .so files stay as they are), their unit tests and a randomized stress of each run under them with
# gcc's libasan/libubsan preloaded; fails on any report (tests/sanitize/run.py). SANITIZE_SEED=n repeats a run.
sanitize: $(DEV)
	$(BIN)/python tests/sanitize/run.py $(SANITIZE_ARGS)

test-fast: $(DEV)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

bench: $(DEV)
	$(BIN)/python bench/bench_transports.py
	$(BIN)/python bench/bench_load.py
	$(BIN)/python bench/bench_rdma.py
	$(BIN)/python bench/bench_sglang.py
	$(BIN)/python bench/bench_vllm.py       # vLLM's Engram layers with and without the plugin: table memory
	$(BIN)/python bench/bench_failover.py   # root: nodes in network namespaces (skips otherwise)
	$(BIN)/python bench/soak.py             # 16 clients + a flood client, every row checked
	$(BIN)/python bench/bench_disk.py       # the disk tier's reader against fio (needs fio)
	$(BIN)/python bench/bench_disk_daemon.py --gib 2
	$(BIN)/python bench/bench_disk_flood.py   # a small disk gather and the daemon's memory under hostile clients

# Engram traffic replay + deadline model on the demo table: bench/out/replay.txt and replay_cdf.png
replay: $(DEV)
	$(BIN)/python bench/replay.py

# Real Prometheus scraping the demo server + multiprocess clients; checks and draws the Grafana dashboard
# (needs Debian's `prometheus`): bench/out/dashboard.png
observe: $(DEV)
	$(BIN)/python bench/observe.py

# Regenerate the committed gRPC stubs (tests/unit/test_proto.py fails when they drift).
proto: $(DEV)
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/tableserver/v1/tableserver.proto

clean:
	rm -rf $(VENV) build *.egg-info tableserver/common/_take*.so client/tableclient/graph/_flags*.so \
		client/tableclient/graph/poller/_native*.so client/tableclient/graph/poller/_verbs*.so tableserver/disk/_diskio*.so
