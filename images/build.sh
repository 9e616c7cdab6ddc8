#!/usr/bin/env bash
# `make image`: natgw-agent's image, from Debian's packages and the project's wheel only (no
# registry is pulled from), with mmdebstrap and podman. Root only.
#
#   images/build.sh [IMAGE]     default localhost/natgw-agent:dev
#
# The base is Debian stable (trixie: nftables 1.1.3, Python 3.13): a release whose packages
# do not move under a tag (alpine:edge moves daily and cannot be pulled here), with the
# distribution's own libnftables binding and every Python library the agent imports packaged
# (structlog, prometheus-client, PyYAML, kubernetes). The agent's container is a container
# of its own in the gateway pod; it need not share the gateway's base, only the kernel.
#
# Two builds from one commit give the same root filesystem: SOURCE_DATE_EPOCH (the commit's
# time unless set) pins every timestamp mmdebstrap, the wheel and the bytecode write (as long
# as Debian's archive holds the same package versions). The tar and its digest stay in
# build/image/ for the tests and for `podman load`-free transfer (`podman save IMAGE`).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${1:-${IMAGE:-localhost/natgw-agent:dev}}
SUITE=trixie
OUT=${IMAGE_OUT:-build/image}  # the tests build into a directory of their own
# What the agent imports at run time, from Debian (tests/test_image.py checks the list
# against pyproject.toml's dependencies); python3-installer only to unpack the wheel, then purged.
PACKAGES=python3,python3-nftables,nftables,python3-structlog,python3-prometheus-client,python3-yaml,python3-kubernetes
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}

say() { echo "images/build.sh: $*" >&2; }
[[ $EUID -eq 0 ]] || { say "must run as root"; exit 2; }
for tool in mmdebstrap podman; do
    command -v "$tool" >/dev/null || { say "installing $tool"; apt-get update -qq;
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap podman runc >/dev/null; }
done

start=$SECONDS
rm -rf "$OUT" && mkdir -p "$OUT/wheel"
# The wheel from this tree, with the build tools the test virtualenv already has (no
# isolation: nothing fetched). PYTHON: the interpreter that has setuptools and wheel.
${PYTHON:-.venv/bin/python} -m pip wheel -q --no-deps --no-build-isolation -w "$OUT/wheel" . >&2
wheel=$(ls "$OUT"/wheel/natgw_agent-*.whl)
say "wheel $(basename "$wheel"); debootstrapping $SUITE (SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH)"

mmdebstrap --quiet --variant=essential --include="$PACKAGES,python3-installer" --format=tar \
    --customize-hook="copy-in $wheel /tmp" \
    --customize-hook="chroot \"\$1\" python3 -m installer --compile-bytecode 0 /tmp/$(basename "$wheel")" \
    --customize-hook="chroot \"\$1\" python3 -m compileall -q --invalidation-mode checked-hash /usr/local/lib" \
    --customize-hook="rm \"\$1\"/tmp/$(basename "$wheel")" \
    --customize-hook="chroot \"\$1\" dpkg --purge python3-installer >/dev/null" \
    --customize-hook="chroot \"\$1\" natgw-agent --help >/dev/null" \
    "$SUITE" "$OUT/root.tar" >&2

sha256sum "$OUT/root.tar" | cut -d' ' -f1 >"$OUT/root.sha256"
# The container's command is the injector's (agent/deploy/inject.py); this default only
# serves a bare `podman run IMAGE`.
podman import --quiet \
    --change 'CMD ["natgw-supervise", "--log-format", "json", "run"]' \
    --change 'ENV PYTHONDONTWRITEBYTECODE=1' \
    --change "LABEL org.opencontainers.image.source=natgw-agent org.opencontainers.image.revision=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
    "$OUT/root.tar" "$IMAGE" >"$OUT/image-id"
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
say "built $IMAGE in $((SECONDS - start)) s: $((size / 1000000)) MB, root filesystem sha256 $(cat "$OUT/root.sha256")"
