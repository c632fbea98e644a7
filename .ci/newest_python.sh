#!/usr/bin/env bash
# make test-newest: runs `$MAKE newest-suite` with a Python >= 3.12, which JAX 0.11 and later
# need. Where the Python comes from, first found wins:
#   1. NEWEST_PYTHON, if given (it must run and be >= 3.12);
#   2. python3.13, python3.12 or python3 on PATH, then pyenv's 3.13 and 3.12 (pyenv's shims
#      fail for a version that is not selected, so each candidate is run, not just found);
#   3. as root on Debian: a Debian 13 (trixie) root, built once by .ci/trixie_root.sh, in
#      which the suite runs (chroot).
# NEWEST_NO_LOCAL=1 skips step 2, to exercise step 3 on a machine that has a local Python.
# Usage (from the Makefile): .ci/newest_python.sh MAKE; NEWEST_JAX names the venv.
set -euo pipefail
trap 'echo "newest_python.sh: failed at line $LINENO" >&2' ERR
cd "$(dirname "$0")/.."
make_cmd=${1:?usage: newest_python.sh MAKE}
venv=".venv-newest-${NEWEST_JAX:?NEWEST_JAX is not set}"

runs_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

local_python() {
    local p root
    for p in python3.13 python3.12 python3; do
        if command -v "$p" >/dev/null && runs_312 "$p"; then command -v "$p"; return; fi
    done
    root=$(pyenv root 2>/dev/null) || return 1
    for p in "$root"/versions/3.13*/bin/python3.13 "$root"/versions/3.12*/bin/python3.12; do
        if [ -x "$p" ] && runs_312 "$p"; then echo "$p"; return; fi
    done
    return 1
}

# The venv is rebuilt when the interpreter that would build it changes (a machine that
# gains a local Python after using the Debian root, or NEWEST_PYTHON pointing elsewhere).
use_venv_for() {
    if [ -e "$venv" ] && [ "$(cat "$venv/.python" 2>/dev/null)" != "$1" ]; then
        rm -rf "$venv"
    fi
    mkdir -p "$venv"
    echo "$1" >"$venv/.python"
}

if [ -n "${NEWEST_PYTHON:-}" ]; then
    if ! runs_312 "$NEWEST_PYTHON"; then
        echo "make test-newest: NEWEST_PYTHON=$NEWEST_PYTHON does not run as Python >= 3.12" >&2
        exit 2
    fi
    python=$NEWEST_PYTHON
elif [ "${NEWEST_NO_LOCAL:-0}" != 1 ] && python=$(local_python); then
    :
elif [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null; then
    use_venv_for "debian-13-root:/usr/bin/python3"
    exec .ci/trixie_root.sh make newest-suite NEWEST_PYTHON=/usr/bin/python3 NEWEST_JAX="$NEWEST_JAX"
else
    echo "make test-newest: no Python >= 3.12 here (NEWEST_PYTHON, python3.13/3.12 on PATH or" \
        "under pyenv), and no Debian 13 root can be built (that needs root on Debian);" \
        "give one with NEWEST_PYTHON=/path/to/python3.12+" >&2
    exit 2
fi
case $python in
    */*) python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python") ;;
    *) python=$(command -v "$python") ;;
esac
use_venv_for "$python"
exec "$make_cmd" newest-suite NEWEST_PYTHON="$python"
