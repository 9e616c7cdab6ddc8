# natgw-agent: `make run` (demo) and `make test` (all tests) work on a fresh Debian machine as root.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := nftables python3-nftables python3-venv conntrack iproute2 iptables systemd util-linux
STAMP := $(VENV)/.installed

.PHONY: deps run test unit netns bench clean

# Debian packages (the nftables binding is only packaged by the distro), then a virtualenv
# made from the distro Python with system site packages so it sees that binding.
deps: $(STAMP)
$(STAMP): pyproject.toml Makefile
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -c 'import nftables' || { echo "the nftables binding is not visible in $(VENV)"; exit 1; }
	touch $(STAMP)

run: deps
	$(PY) -m agent.demo

test: deps
	$(PY) -m pytest tests netns-tests bench/test_quick.py

unit: deps
	$(PY) -m pytest tests

netns: deps
	$(PY) -m pytest netns-tests

# The side-by-side benchmark (legacy script, kube-proxy style, the agent; data plane vs an
# iptables chain): about 10 minutes; writes BENCHMARKS.md and benchmarks-sync.png.
bench: deps
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
