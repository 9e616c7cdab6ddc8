#!/usr/bin/env bash
# A Debian root on this machine, to run natgw-agent's whole suite against another
# release's nftables and Python without a container runtime. Root only.
#
#   root.sh SUITE build [ROOT]                debootstrap ROOT (skipped when a complete build is there)
#   root.sh SUITE run [ROOT] REPO -- CMD...   run CMD inside ROOT, in REPO (seen at /src/natgw-agent)
#
# SUITE: trixie (Debian 13: nftables 1.1.3, Python 3.13) or sid (unstable: nftables 1.1.7,
# Python 3.14, as of 2026-12). ROOT defaults to /var/tmp/natgw-agent-SUITE: outside the
# repository, because the repository is mounted inside the root. debootstrap uses Debian's
# default mirror; DEBIAN_MIRROR names another.
set -euo pipefail

SUITE=${1:-}
case "$SUITE" in
    trixie|sid) shift ;;
    *) echo "root.sh: usage: $0 trixie|sid build [ROOT] | $0 trixie|sid run [ROOT] REPO -- CMD..." >&2; exit 2 ;;
esac
DEFAULT_ROOT=/var/tmp/natgw-agent-$SUITE
[[ $SUITE == trixie ]] && DEFAULT_ROOT=/var/tmp/natgw-agent-debian13  # where earlier builds are
MIRROR=${DEBIAN_MIRROR:-}
PACKAGES=make,git,python3,python3-venv,python3-pip,python3-yaml,iproute2,procps,ca-certificates
# The stamp holds the recipe: a root built by another recipe is rebuilt, not reused.
RECIPE="debootstrap --variant=minbase --include=$PACKAGES $SUITE $MIRROR"
STAMP=.natgw-root-complete
INNER_REPO=/src/natgw-agent
# The machine's CA bundle (it has CAs of its own, e.g. an egress proxy's) goes to a path of
# its own: the root's /etc/ssl/certs/ca-certificates.crt is rewritten whenever apt-get runs
# update-ca-certificates there.
INNER_CA=/etc/ssl/natgw-host-ca-bundle.crt
HOST_CA=/etc/ssl/certs/ca-certificates.crt
# Passed into the root when set (everything else is dropped: host paths mean nothing there).
PASS_ENV=(CI TERM PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_DEFAULT_TIMEOUT PIP_DISABLE_PIP_VERSION_CHECK
          http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY)

say() { echo "root.sh: $*" >&2; }
die() { say "$*"; exit 2; }
usage() { die "usage: $0 trixie|sid build [ROOT] | $0 trixie|sid run [ROOT] REPO -- CMD..."; }

# Mount targets at or under $1, deepest first, as findmnt lists them in this mount namespace.
mounts_under() {
    findmnt -rn -o TARGET | awk -v d="$1" '$0 == d || index($0, d "/") == 1' | sort -r
}

check_root_path() {
    local root=$1
    [[ $root == /* && $root != / && $root != *[[:space:]]* ]] \
        || die "ROOT must be an absolute path other than / without blanks: '$root'"
}

# rm -rf of an earlier (partial) root; never across file systems and never with
# something still mounted in it (a live `run` in this namespace).
remove_tree() {
    local dir=$1
    [[ -e $dir ]] || return 0
    [[ -z $(mounts_under "$dir") ]] || die "$dir has mounts in it (in use?): $(mounts_under "$dir" | tr '\n' ' ')"
    rm -rf --one-file-system -- "$dir"
}

build() {
    local root=$1 start
    check_root_path "$root"
    mkdir -p "$(dirname "$root")"
    exec 9>"$root.lock"
    flock 9   # one build at a time; `run` holds this lock shared
    if [[ -f $root/$STAMP && $(cat "$root/$STAMP") == "$RECIPE" ]]; then
        say "$root is complete ($(cat "$root/etc/debian_version" 2>/dev/null || echo '?')): not rebuilt"
        return 0
    fi
    if ! command -v debootstrap >/dev/null; then
        say "installing debootstrap"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    fi
    # Into a fresh directory, renamed only once complete: an interrupted build leaves no
    # ROOT behind (its .partial is removed by the next build).
    local new=$root.partial
    remove_tree "$new"
    remove_tree "$root"
    mkdir -p "$new"
    start=$SECONDS
    say "debootstrap $SUITE into $new"
    # In a mount namespace of its own: the proc/sys mounts debootstrap makes in the target
    # vanish with it, even if it is killed.
    unshare --mount --propagation private \
        debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$new" ${MIRROR:+"$MIRROR"} >"$root.debootstrap.log" 2>&1 \
        || { tail -n 30 "$root.debootstrap.log" >&2; die "debootstrap failed (log: $root.debootstrap.log)"; }
    if [[ $SUITE == sid ]]; then
        # sid's Release file as the mirror serves it may be past its Valid-Until date
        # (seen here 2026-12); apt-get update inside the root then refuses it.
        echo 'Acquire::Check-Valid-Until "false";' >"$new/etc/apt/apt.conf.d/90natgw-valid-until"
    fi
    echo "$RECIPE" >"$new/$STAMP"
    mv -T "$new" "$root"
    say "built $root (Debian $(cat "$root/etc/debian_version")) in $((SECONDS - start)) s"
}

# ---------------------------------------------------------------------------------- run

MOUNTED=()
NETNS_TARGET=
ROOT_IN_USE=

# Processes the command left running in the root (in this mount namespace; e.g. a child
# that ignored Ctrl-C) would keep the root's mounts alive: say so and end them.
in_root() {
    local p ns
    ns=$(readlink /proc/$$/ns/mnt)
    for p in /proc/[0-9]*; do
        [[ $(readlink "$p/root" 2>/dev/null) == "$ROOT_IN_USE" ]] || continue
        [[ $(readlink "$p/ns/mnt" 2>/dev/null) == "$ns" ]] || continue
        echo "${p#/proc/}"
    done
}

end_leftovers() {
    [[ -n $ROOT_IN_USE ]] || return 0
    local left
    left=$(in_root)
    [[ -n $left ]] || return 0
    say "ending processes left in the root: $(echo $left)"
    kill -TERM $left 2>/dev/null || true
    sleep 2
    left=$(in_root)
    [[ -z $left ]] || kill -KILL $left 2>/dev/null || true
}

cleanup() {
    local rc=$? t i
    trap - EXIT INT TERM HUP
    end_leftovers
    # Our copy of /run/netns is a peer of the host's (so namespaces are visible both ways);
    # made a slave first, unmounting it cannot take the host's namespace mounts with it.
    if [[ -n $NETNS_TARGET ]]; then
        mount --make-rslave "$NETNS_TARGET" 2>/dev/null || true
    fi
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
        t=${MOUNTED[i]}
        mountpoint -q "$t" || continue
        umount -R "$t" 2>/dev/null || umount -R -l "$t" || say "could not unmount $t"
    done
    MOUNTED=()
    exit "$rc"
}

# mount ARGS... TARGET, remembered for cleanup.
do_mount() {
    local target=${*: -1}
    mount "$@"
    MOUNTED+=("$target")
}

run() {
    local root=$1 repo=$2; shift 2
    check_root_path "$root"
    [[ -f $root/$STAMP ]] || die "$root is not a complete root: run '$0 build $root' first"
    [[ -d $repo ]] || die "no repository at $repo"
    repo=$(realpath "$repo")
    case "$root/" in "$repo"/*) die "ROOT ($root) must not be inside the repository ($repo)";; esac
    case "$repo/" in "$root"/*) die "the repository ($repo) must not be inside ROOT ($root)";; esac

    if [[ ${NATGW_ROOT_NS:-} != "$$" ]]; then
        # Namespaces made inside the root must be mounts in the host's /run/netns peer group
        # to be visible outside: make /run/netns a shared mount point as `ip netns add` does
        # on first use (it stays, as it does after any `ip netns add`).
        mkdir -p /run/netns /run/ngw-lab
        if ! mountpoint -q /run/netns; then
            mount --bind /run/netns /run/netns
        fi
        [[ $(findmnt -n -o PROPAGATION /run/netns) == shared* ]] || mount --make-shared /run/netns
        # Everything below happens in a mount namespace of this process (unshare execs, same
        # pid): the host never sees these mounts, and they go with it and its children, even on
        # SIGKILL.
        # --propagation unchanged keeps /run/netns a peer of the host's.
        NATGW_ROOT_NS=$$ exec unshare --mount --propagation unchanged -- "$0" "$SUITE" run "$root" "$repo" -- "$@"
    fi

    exec 9>"$root.lock"
    flock -s 9   # no rebuild while we run

    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    trap 'exit 129' HUP

    # The mounts holding ROOT and REPO may be shared with the host (systemd makes / shared):
    # made slaves in this namespace, nothing mounted under them propagates out.
    local t
    for t in "$(findmnt -n -o TARGET -T "$root")" "$(findmnt -n -o TARGET -T "$repo")"; do
        mount --make-slave "$t"
    done

    # ROOT bound onto itself: `ip netns exec` does `mount --make-rslave /`, which fails in a
    # chroot whose / is not a mount point.
    do_mount --bind "$root" "$root"
    mount --make-private "$root"
    do_mount -t proc proc "$root/proc"
    do_mount --rbind /sys "$root/sys"
    mount --make-rslave "$root/sys"
    do_mount --rbind /dev "$root/dev"
    mount --make-rslave "$root/dev"
    mkdir -p "$root/run/netns" "$root/run/ngw-lab" "$root$INNER_REPO"
    NETNS_TARGET=$root/run/netns
    do_mount --rbind /run/netns "$NETNS_TARGET"
    # The test lab's liveness locks (its LOCK_DIR): shared with the host, so that a suite on
    # either side never takes the other's live lab namespaces for a crashed lab's leftovers.
    do_mount --bind /run/ngw-lab "$root/run/ngw-lab"
    mount --make-private "$root/run/ngw-lab"
    do_mount --bind "$repo" "$root$INNER_REPO"
    mount --make-private "$root$INNER_REPO"

    # Name resolution and the machine's CAs, so apt-get and pip reach the registries.
    rm -f "$root/etc/resolv.conf"
    cp -L /etc/resolv.conf "$root/etc/resolv.conf"
    if [[ -f $HOST_CA ]]; then
        cp -L "$HOST_CA" "$root$INNER_CA"
        echo "Acquire::https::CAInfo \"$INNER_CA\";" >"$root/etc/apt/apt.conf.d/90natgw-host-ca"
    else
        cp -L "$root/etc/ssl/certs/ca-certificates.crt" "$root$INNER_CA"
    fi

    local envs=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
                LANG=C.UTF-8 SHELL=/bin/bash DEBIAN_FRONTEND=noninteractive
                PIP_CERT=$INNER_CA SSL_CERT_FILE=$INNER_CA REQUESTS_CA_BUNDLE=$INNER_CA
                CURL_CA_BUNDLE=$INNER_CA GIT_SSL_CAINFO=$INNER_CA)
    local v
    for v in "${PASS_ENV[@]}"; do
        if [[ -n ${!v+x} ]]; then envs+=("$v=${!v}"); fi
    done

    local rc=0
    ROOT_IN_USE=$root
    chroot "$root" /usr/bin/env -i --chdir="$INNER_REPO" "${envs[@]}" "$@" 9>&- || rc=$?

    return "$rc"
}

[[ $EUID -eq 0 ]] || die "must run as root"
cmd=${1:-}; shift || true
case "$cmd" in
    build)
        (($# <= 1)) || usage
        build "$(realpath -m "${1:-$DEFAULT_ROOT}")"
        ;;
    run)
        args=()
        while (($#)) && [[ $1 != -- ]]; do args+=("$1"); shift; done
        (($# >= 2)) || usage   # "--" and a command
        shift
        case ${#args[@]} in
            1) run "$DEFAULT_ROOT" "${args[0]}" "$@" ;;
            2) run "$(realpath -m "${args[0]}")" "${args[1]}" "$@" ;;
            *) usage ;;
        esac
        ;;
    *) usage ;;
esac
