#!/usr/bin/env bash
# Make a headless browser available for the demo's browser test (tests/test_demo_browser.py).
#
# The test drives Debian's `chromium` package with the python `playwright` client (installed by
# scripts/setup.sh through the `demo` extra); playwright's own browser download is not used (no
# internet on the project's machines, only package registries). This script installs `chromium` with
# apt-get when it is missing and we may (root, or passwordless sudo). It never fails the caller: when the
# browser cannot be installed it says why, and the browser test is then skipped with that reason.
#
# Usage: bash scripts/setup_browser.sh       (idempotent; prints the browser path)
#        MMSPEC_CHROMIUM=/path/to/chromium   use another binary (the test reads the same variable)
set -uo pipefail

find_browser() {
    for candidate in "${MMSPEC_CHROMIUM:-}" /usr/bin/chromium /usr/bin/chromium-browser; do
        if [ -n "$candidate" ] && [ -x "$candidate" ]; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

if browser=$(find_browser); then
    echo "browser for the demo test: $browser"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_browser: no chromium and no apt-get here: the demo's browser test will be skipped" >&2
    exit 0
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        echo "setup_browser: chromium is missing and installing it needs root: the demo's browser test will be" \
             "skipped (run: sudo apt-get install -y chromium)" >&2
        exit 0
    fi
fi

export DEBIAN_FRONTEND=noninteractive
echo "setup_browser: installing Debian's chromium with apt-get"
if ! ${SUDO[@]+"${SUDO[@]}"} apt-get install -y -q --no-install-recommends chromium >/tmp/mmspec_setup_browser.log 2>&1; then
    # the package lists may be stale or absent on a fresh machine
    ${SUDO[@]+"${SUDO[@]}"} apt-get update -q >>/tmp/mmspec_setup_browser.log 2>&1 || true
    ${SUDO[@]+"${SUDO[@]}"} apt-get install -y -q --no-install-recommends chromium >>/tmp/mmspec_setup_browser.log 2>&1 || true
fi

if browser=$(find_browser); then
    echo "browser for the demo test: $browser"
else
    echo "setup_browser: apt-get could not install chromium (log: /tmp/mmspec_setup_browser.log): the demo's" \
         "browser test will be skipped" >&2
    tail -n 5 /tmp/mmspec_setup_browser.log >&2 || true
fi
exit 0
