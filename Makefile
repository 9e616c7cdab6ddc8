# natgw-agent: `make run` (demo) and `make test` (all tests) work on a fresh Debian machine as root.
SHELL := /bin/bash
# Overridable: inside the Debian 13 root the suite needs a virtualenv of that root's Python.
VENV ?= .venv
PY := $(VENV)/bin/python
APT_PACKAGES := nftables python3-nftables python3-venv conntrack iproute2 iptables systemd util-linux openssl prometheus
# Debian's prometheus (the monitoring tests' server and promtool) is a daemon its package
# starts on 0.0.0.0:9090 (systemd or its init script, in a root too) and enables at boot,
# and it recommends node-exporter (another listener): installed without recommends (the
# other packages with theirs, as before), under a
# policy-rc.d that forbids starting services (when the system has none of its own), and
# disabled, so nothing the tests install listens on the machine's network.
STAMP := $(VENV)/.installed

# The Debian roots the suite also runs in: Debian 13 (trixie: nftables 1.1.3, Python 3.13)
# and sid (unstable: nftables 1.1.7, Python 3.14, what a fresh alpine:edge build carries);
# outside the repository, which is mounted inside them. Built once each by images/debian/root.sh.
DEBIAN13_ROOT ?= /var/tmp/natgw-agent-debian13
DEBIAN13_VENV := .venv-debian13
SID_ROOT ?= /var/tmp/natgw-agent-sid
SID_VENV := .venv-sid

.PHONY: deps run image test test-here test-image test-debian13 test-sid unit netns bench bench-busy bench-busy-debian13 bench-busy-report \
	bench-cleanup bench-cleanup-report bench-footprint bench-checks clean

# Debian packages (the nftables binding is only packaged by the distro), then a virtualenv
# made from the distro Python with system site packages so it sees that binding.
deps: $(STAMP)
$(STAMP): pyproject.toml Makefile
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		policy=/usr/sbin/policy-rc.d; own=; \
		if [ ! -e $$policy ]; then printf '#!/bin/sh\nexit 101\n' >$$policy && chmod 755 $$policy && own=1; fi; \
		all=" $$(echo $$missing) "; quiet=; rest=$${all/ prometheus / }; [ "$$rest" = "$$all" ] || quiet=prometheus; \
		apt-get update -qq && \
		{ [ -z "$${rest// /}" ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$rest; } && \
		{ [ -z "$$quiet" ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$quiet; }; \
		rc=$$?; if [ -n "$$own" ]; then rm -f $$policy; fi; [ $$rc = 0 ] || exit $$rc; \
		if [ -e /lib/systemd/system/prometheus.service ]; then systemctl disable prometheus >/dev/null 2>&1 || true; fi; \
	fi
	test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -c 'import nftables' || { echo "the nftables binding is not visible in $(VENV)"; exit 1; }
	touch $(STAMP)

run: deps
	$(PY) -m lab.demo

# The agent's image, from Debian's packages and this tree's wheel (images/build.sh), as
# localhost/natgw-agent:dev unless IMAGE= says otherwise.
IMAGE ?= localhost/natgw-agent:dev
image: deps
	PYTHON=$(PY) images/build.sh $(IMAGE)

# All tests: this system's suite, then the same suite in the Debian 13 root and in the sid
# root (one after the other, never at once: all use the kernel's nftables and network
# namespaces). All run even if one fails; the summary names the systems that failed.
test:
	@failed=; \
	$(MAKE) --no-print-directory test-here PYTEST_ARGS="$(NO_IMAGE)" || failed="$$failed, this system ($$(. /etc/os-release; echo $$PRETTY_NAME))"; \
	$(MAKE) --no-print-directory test-image || failed="$$failed, the image ($(TEST_IMAGE_NAME))"; \
	$(MAKE) --no-print-directory test-debian13 || failed="$$failed, the Debian 13 root ($(DEBIAN13_ROOT))"; \
	$(MAKE) --no-print-directory test-sid || failed="$$failed, the sid root ($(SID_ROOT))"; \
	if [ -n "$$failed" ]; then echo "make test: FAILED on$${failed#,}" >&2; exit 1; fi; \
	echo "make test: passed on this system, its image, in the Debian 13 root and in the sid root"

# This system's suite only (whatever system make runs on; inside the root, Debian 13's).
# PYTEST_ARGS: more pytest arguments (the roots' runs and `test` pass NO_IMAGE).
test-here: deps
	$(PY) -m pytest tests netns-tests bench/test_quick.py $(PYTEST_ARGS)

# The agent's image run as a gateway pod (netns-tests/test_image.py) and the systemd unit
# on a Debian host root with systemd as PID 1 (test_systemd.py), on this host only: podman
# runs no container inside the Debian roots. Builds localhost/natgw-agent:test
# first (about 50 s) unless NATGW_TEST_IMAGE names a built image.
NO_IMAGE := --ignore=netns-tests/test_image.py --ignore=netns-tests/test_systemd.py
TEST_IMAGE_NAME = $(or $(NATGW_TEST_IMAGE),localhost/natgw-agent:test)
test-image: deps
	@missing=$$(for p in mmdebstrap podman runc; do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	$(PY) -m pytest netns-tests/test_image.py netns-tests/test_systemd.py

# The suite in the Debian 13 root: builds the root when missing, then runs test-here there
# with a virtualenv of its own (deps installs the Debian packages inside the root).
test-debian13:
	images/debian/root.sh trixie build $(DEBIAN13_ROOT)
	images/debian/root.sh trixie run $(DEBIAN13_ROOT) $(CURDIR) -- make VENV=$(DEBIAN13_VENV) PYTEST_ARGS="$(NO_IMAGE)" test-here

# The same in the sid root (nftables 1.1.7, Python 3.14).
test-sid:
	images/debian/root.sh sid build $(SID_ROOT)
	images/debian/root.sh sid run $(SID_ROOT) $(CURDIR) -- make VENV=$(SID_VENV) PYTEST_ARGS="$(NO_IMAGE)" test-here

unit: deps
	$(PY) -m pytest tests

netns: deps
	$(PY) -m pytest netns-tests

# The side-by-side benchmark (legacy script, kube-proxy style, the agent; data plane vs an
# iptables chain): about 10 minutes; writes BENCHMARKS.md and benchmarks-sync.png. Then the
# busy neighbour benchmark (bench/busy.py, a minute or two each) on this system and in the
# Debian 13 root, one after the other, and its section of BENCHMARKS.md from both results.
# Both busy runs happen even if the first fails; the section shows what there is. Then the
# cleanup benchmark (bench/cleanup.py, about a minute): 2,000 identities with flows removed
# while another identity changes, this tree beside CLEANUP_BASELINE, and its section.
BUSY_N ?= 10000
BUSY_JSON ?= build/bench-busy.json
BUSY_JSON_HERE := build/bench-busy-here.json
BUSY_JSON_DEBIAN13 := build/bench-busy-debian13.json
CLEANUP_N ?= 2000
CLEANUP_BASELINE ?= 6fa07f8
CLEANUP_JSON ?= build/bench-cleanup.json

bench: deps
	$(PY) -m bench.run
	@failed=; \
	$(MAKE) --no-print-directory bench-busy BUSY_JSON=$(BUSY_JSON_HERE) || failed="$$failed, this system"; \
	$(MAKE) --no-print-directory bench-busy-debian13 || failed="$$failed, the Debian 13 root"; \
	$(MAKE) --no-print-directory bench-busy-report || failed="$$failed, the report"; \
	if [ -n "$$failed" ]; then echo "make bench: busy neighbour FAILED on$${failed#,}" >&2; fi; \
	cleanup=; \
	$(MAKE) --no-print-directory bench-cleanup || cleanup="$$cleanup, the run"; \
	$(MAKE) --no-print-directory bench-cleanup-report || cleanup="$$cleanup, the report"; \
	if [ -n "$$cleanup" ]; then echo "make bench: cleanup FAILED: $${cleanup#, }" >&2; fi; \
	footprint=; \
	$(MAKE) --no-print-directory bench-footprint || footprint=" footprint FAILED"; \
	if [ -n "$$footprint" ]; then echo "make bench:$$footprint" >&2; fi; \
	checks=; \
	$(MAKE) --no-print-directory bench-checks || checks=" health checks FAILED"; \
	if [ -n "$$checks" ]; then echo "make bench:$$checks" >&2; fi; \
	[ -z "$$failed$$cleanup$$footprint$$checks" ]

# The busy neighbour benchmark on whatever system make runs on; its JSON into BUSY_JSON
# (progress on stderr).
bench-busy: deps
	@mkdir -p $(dir $(BUSY_JSON)) && rm -f $(BUSY_JSON)
	$(PY) -m bench.busy --n $(BUSY_N) --json $(BUSY_JSON) >/dev/null

# The same in the Debian 13 root (nftables 1.1.3, Python 3.13); the repository is mounted
# there, so its JSON lands in this tree's build/.
bench-busy-debian13:
	images/debian/root.sh trixie build $(DEBIAN13_ROOT)
	images/debian/root.sh trixie run $(DEBIAN13_ROOT) $(CURDIR) -- make VENV=$(DEBIAN13_VENV) BUSY_N=$(BUSY_N) \
		BUSY_JSON=$(BUSY_JSON_DEBIAN13) bench-busy

# The busy neighbour section of BENCHMARKS.md from the two results (the rest of the file stays).
bench-busy-report:
	$(PY) -m bench.report --busy $(BUSY_JSON_HERE) $(BUSY_JSON_DEBIAN13)

# The cleanup benchmark on this system, this tree beside CLEANUP_BASELINE; its JSON into
# CLEANUP_JSON (progress on stderr).
bench-cleanup: deps
	@mkdir -p $(dir $(CLEANUP_JSON)) && rm -f $(CLEANUP_JSON)
	$(PY) -m bench.cleanup --n $(CLEANUP_N) --baseline $(CLEANUP_BASELINE) --json $(CLEANUP_JSON) >/dev/null

# The cleanup section of BENCHMARKS.md from that result (the rest of the file stays).
bench-cleanup-report:
	$(PY) -m bench.report --cleanup $(CLEANUP_JSON)

# Memory per size (1,000, 10,000, 20,000 identities x 4), reaction and idle CPU on the
# Kubernetes path, this tree beside FOOTPRINT_BASELINE (the code before issue 13), about 20
# minutes; then its section of BENCHMARKS.md.
FOOTPRINT_BASELINE ?= a05ea73
FOOTPRINT_JSON ?= build/bench-footprint.json
bench-footprint: deps
	@mkdir -p $(dir $(FOOTPRINT_JSON)) && rm -f $(FOOTPRINT_JSON)
	$(PY) -m bench.footprint --baseline $(FOOTPRINT_BASELINE) --json $(FOOTPRINT_JSON) >/dev/null
	$(PY) -m bench.footprint_report $(FOOTPRINT_JSON)

# The health checks' cost (issue 23; bench/checks.py, about 10 minutes): the agent's CPU at
# 10,000 identities x 4 answering backends with checks off and on, at 100 x 4, and with a
# quarter of the backends refusing; checks a second, the stretch, a sync while they run.
# Then its section of BENCHMARKS.md.
CHECKS_JSON ?= build/bench-checks.json
bench-checks: deps
	@mkdir -p $(dir $(CHECKS_JSON)) && rm -f $(CHECKS_JSON)
	$(PY) -m bench.checks --json $(CHECKS_JSON) >/dev/null
	$(PY) -m bench.checks_report $(CHECKS_JSON)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
