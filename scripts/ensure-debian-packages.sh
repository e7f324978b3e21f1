#!/usr/bin/env bash
# Make sure the commands a target needs are present, installing the Debian
# packages that provide the missing ones.
#
#   scripts/ensure-debian-packages.sh CMD:PKG [CMD:PKG ...]
#
# CMD is looked up on PATH and in the sbin directories (mosquitto lives in
# /usr/sbin, which is not on every user's PATH); an absolute CMD is a file that
# must exist (e.g. a header). A bare PKG means CMD = PKG. apt-get runs only if something is missing:
# `apt-get update` once, then one `apt-get install` for all missing packages.
# sudo is used only when not root. Services are not started by the install
# (a temporary policy-rc.d is put in place if the machine has none).
set -euo pipefail

have() {
    local cmd=$1
    if [[ $cmd == /* ]]; then
        [[ -e $cmd ]]
        return
    fi
    command -v "$cmd" >/dev/null 2>&1 && return 0
    local d
    for d in /usr/local/sbin /usr/sbin /sbin; do
        [[ -x $d/$cmd ]] && return 0
    done
    return 1
}

if [[ $# -eq 0 ]]; then
    echo "usage: $0 CMD:PKG [CMD:PKG ...]" >&2
    exit 2
fi

missing_pkgs=()
missing_cmds=()
for spec in "$@"; do
    if [[ $spec == *:* ]]; then
        cmd=${spec%%:*}
        pkg=${spec#*:}
    else
        cmd=$spec
        pkg=$spec
    fi
    if [[ -z $cmd || -z $pkg ]]; then
        echo "ensure-debian-packages: bad spec '$spec' (want CMD:PKG)" >&2
        exit 2
    fi
    if ! have "$cmd"; then
        missing_cmds+=("$cmd")
        # de-duplicate packages (several commands may come from one package)
        dup=0
        for p in "${missing_pkgs[@]+"${missing_pkgs[@]}"}"; do
            [[ $p == "$pkg" ]] && dup=1
        done
        [[ $dup -eq 0 ]] && missing_pkgs+=("$pkg")
    fi
done

[[ ${#missing_pkgs[@]} -eq 0 ]] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-debian-packages: missing ${missing_cmds[*]} and no apt-get here;" \
         "install these packages by hand: ${missing_pkgs[*]}" >&2
    exit 1
fi

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "ensure-debian-packages: need root or sudo to install: ${missing_pkgs[*]}" >&2
        exit 1
    fi
    SUDO=(sudo)
fi
APT=("${SUDO[@]+"${SUDO[@]}"}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300)

# Keep package maintainer scripts from starting services (e.g. a system-wide
# mosquitto on port 1883) unless the machine already has a policy about it.
POLICY=/usr/sbin/policy-rc.d
made_policy=0
cleanup() {
    if [[ $made_policy -eq 1 ]]; then
        "${SUDO[@]+"${SUDO[@]}"}" rm -f "$POLICY"
    fi
}
trap cleanup EXIT
if [[ ! -e $POLICY ]]; then
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]+"${SUDO[@]}"}" tee "$POLICY" >/dev/null
    "${SUDO[@]+"${SUDO[@]}"}" chmod 755 "$POLICY"
    made_policy=1
fi

echo "ensure-debian-packages: installing ${missing_pkgs[*]} (for ${missing_cmds[*]})" >&2
"${APT[@]}" update -q
"${APT[@]}" install -y -q --no-install-recommends "${missing_pkgs[@]}"

still=()
for cmd in "${missing_cmds[@]}"; do
    have "$cmd" || still+=("$cmd")
done
if [[ ${#still[@]} -gt 0 ]]; then
    echo "ensure-debian-packages: still missing after install: ${still[*]}" >&2
    exit 1
fi
