#!/usr/bin/env bash
# Runs a command in this repository inside a Debian 13 (trixie) root, whose python3 is 3.13,
# for machines without a Python >= 3.12 (the package registry serves JAX 0.11 and later only
# for those). The root is built once by debootstrap from the Debian mirror apt already uses
# (about 2 minutes, 650 MB measured by du) under .newest-root/, and reused. The repository is bind-mounted
# at its own path inside, so a venv made inside works on every later run; /proc, /dev and
# /sys are bound for the time of the command. Needs root on Debian.
# Usage: .ci/trixie_root.sh COMMAND [ARG...]   (NEWEST_DEBIAN_MIRROR overrides the mirror)
set -euo pipefail
trap 'echo "trixie_root.sh: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."
repo=$(pwd)
cache=$repo/.newest-root
root=$cache/trixie
ready=$root/.autocast-root-complete  # written last: a root without it is a failed build

mounts_under() { awk -v p="$1/" 'index($5 "/", p) == 1 { print $5 }' /proc/self/mountinfo; }

mirror() {
    if [ -n "${NEWEST_DEBIAN_MIRROR:-}" ]; then echo "$NEWEST_DEBIAN_MIRROR"; return; fi
    # The first non-security URI of apt's sources, in deb822 ("URIs: ...") or one-line
    # ("deb [options] URI suite ...") form; sed, not head, so no pipe breaks under pipefail.
    { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null || true; } |
        sed -n -e 's/^URIs:[[:space:]]*//p' \
            -e 's/^deb[[:space:]]\{1,\}\(\[[^]]*\][[:space:]]*\)\{0,1\}\([^[:space:]]*\).*/\2/p' |
        tr -s ' \t' '\n\n' | grep -v -e security -e '^$' | sed -n 1p
}

build() {
    local url
    url=$(mirror)
    if [ -z "$url" ]; then
        echo "trixie_root.sh: apt's sources name no Debian mirror; set NEWEST_DEBIAN_MIRROR" >&2
        exit 2
    fi
    if ! command -v debootstrap >/dev/null; then
        apt-get install -y -qq debootstrap >/dev/null 2>&1 ||
            { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
    fi
    if [ -n "$(mounts_under "$root")" ]; then
        echo "trixie_root.sh: $root has mounts left (a run killed midway?); unmount them first:" \
            "$(mounts_under "$root" | tr '\n' ' ')" >&2
        exit 2
    fi
    rm -rf --one-file-system "$root"
    mkdir -p "$root"
    echo "Building a Debian 13 root in $root from $url, once (about 2 minutes; log: $cache/debootstrap.log)"
    if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,git,make,gcc \
        trixie "$root" "$url" >"$cache/debootstrap.log" 2>&1; then
        tail -n 20 "$cache/debootstrap.log" >&2
        echo "trixie_root.sh: debootstrap failed (log above and in $cache/debootstrap.log)" >&2
        exit 1
    fi
    touch "$ready"
}

mkdir -p "$cache"
# One run at a time: they share the root and its mounts.
exec 9>"$cache/lock"
flock 9
[ -e "$ready" ] || build

# Names resolve as outside: the host's name servers, for pip, and its hosts file, for the
# multi-process tests (gloo looks the machine's own name up). pip inside must reach the
# registry as it does outside: the CA bundle PIP_CERT (or pip's configuration) names, the
# index and proxies the host uses.
for f in resolv.conf hosts; do
    rm -f "$root/etc/$f"  # a link there would be followed out of the root
    cp -L "/etc/$f" "$root/etc/$f"
done
host_pip() { python3 -m pip config get "$1" 2>/dev/null || true; }
cert=${PIP_CERT:-$(host_pip global.cert)}
env_in=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8)
if [ -n "$cert" ] && [ -f "$cert" ]; then
    cp -L "$cert" "$root/etc/ssl/host-ca-bundle.crt"
    env_in+=(PIP_CERT=/etc/ssl/host-ca-bundle.crt SSL_CERT_FILE=/etc/ssl/host-ca-bundle.crt
        REQUESTS_CA_BUNDLE=/etc/ssl/host-ca-bundle.crt)
fi
index=${PIP_INDEX_URL:-$(host_pip global.index-url)}
case $index in http*) env_in+=(PIP_INDEX_URL="$index") ;; esac
# The make variables the suite reads (not MAKEFLAGS: a jobserver outside means nothing
# inside); JAX's and XLA's own settings too.
for v in NEWEST_JAX TEST_WORKERS PYTEST_ARGS PYTEST_ADDOPTS PIP_DEFAULT_TIMEOUT \
    PIP_DISABLE_PIP_VERSION_CHECK http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY \
    $(compgen -e | grep -E '^(JAX|XLA)_' || true); do
    if [ -n "${!v+set}" ]; then env_in+=("$v=${!v}"); fi
done

bound=()
unbind() {
    local i
    for ((i = ${#bound[@]} - 1; i >= 0; i--)); do
        umount -R "${bound[i]}" 2>/dev/null || umount -R -l "${bound[i]}"
    done
}
trap unbind EXIT
bind() {  # bind SOURCE TARGET [rbind]: TARGET under the root; rbind for /dev (its shm, pts)
    mkdir -p "$root$2"
    mount "--${3:-bind}" "$1" "$root$2"
    bound+=("$root$2")  # from here on unmounted on exit, whatever happens next
    if [ "${3:-}" = rbind ]; then
        mount --make-rslave "$root$2"  # unmounting inside must not reach the host's mounts
    fi
}
bind /proc /proc
bind /dev /dev rbind
bind /sys /sys
bind "$repo" "$repo"

status=0
env -i "${env_in[@]}" chroot "$root" /bin/sh -c 'cd "$1" && shift && exec "$@"' sh "$repo" "$@" || status=$?
exit $status
