#!/usr/bin/env bash
# Fetch a lavapipe with cooperative matrices (Mesa >= 26, from Debian trixie-backports) into a
# private folder, with the trixie libraries it was built against, glibc included; the system's
# Vulkan drivers and apt configuration are not touched. Bookworm's lavapipe (Mesa 22) has no
# cooperative matrices, so without this the cooperative-matrix attention kernels never run in CI.
#
#   scripts/fetch_lavapipe.sh                  # fetch if missing; print the folder
#   scripts/fetch_lavapipe.sh --run CMD ...    # fetch if missing, then run CMD on that lavapipe
#
# CMD runs under trixie's dynamic loader and libraries (this lavapipe needs glibc 2.38), with
# VK_DRIVER_FILES naming only this lavapipe; a process CMD starts runs on the system's libraries
# again and does not see it. The folder is $FLOWGRAD_LAVAPIPE_ROOT, default
# ~/.cache/flowgrad/lavapipe-trixie. Needs network access to deb.debian.org.
set -euo pipefail

root="${FLOWGRAD_LAVAPIPE_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/flowgrad/lavapipe-trixie}"
want=26     # the first Mesa whose lavapipe offers VK_KHR_cooperative_matrix
libs="$root/usr/lib/x86_64-linux-gnu"

fail() {
    echo "fetch_lavapipe.sh: $1" >&2
    echo "fetch_lavapipe.sh: the cooperative-matrix tests need lavapipe from Mesa >= $want: allow access to" \
         "deb.debian.org (trixie-backports' mesa-vulkan-drivers is fetched from there)" >&2
    exit 1
}

fetch() {
    command -v apt-get >/dev/null && command -v dpkg >/dev/null || fail "apt-get and dpkg are needed to fetch it"
    [ "$(dpkg --print-architecture)" = amd64 ] || fail "only amd64 is fetched (this is $(dpkg --print-architecture))"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/state"
    touch "$work/state/status"      # nothing installed: apt resolves the whole set of libraries
    printf 'deb http://deb.debian.org/debian trixie main\ndeb http://deb.debian.org/debian trixie-backports main\n' \
        >"$work/sources.list"
    local apt_opts=(-q -o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
                    -o "Dir::State=$work/state" -o "Dir::State::status=$work/state/status"
                    -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
                    -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null
                    -o Debug::NoLocking=1 -o Acquire::Retries=3 -o APT::Sandbox::User="$(id -un)")
    apt-get "${apt_opts[@]}" update >"$work/log" 2>&1 || { cat "$work/log" >&2; fail "apt-get update of trixie failed"; }
    apt-get "${apt_opts[@]}" install -y --download-only --no-install-recommends -t trixie-backports \
        mesa-vulkan-drivers >>"$work/log" 2>&1 || { cat "$work/log" >&2; fail "downloading trixie's lavapipe failed"; }
    rm -rf "$root.new"
    mkdir -p "$root.new"
    for deb in "$work"/cache/archives/*.deb; do dpkg -x "$deb" "$root.new"; done
    dpkg-deb -f "$work"/cache/archives/mesa-vulkan-drivers_*.deb Version >"$root.new/mesa-version"
    rm -rf "$root"
    mv "$root.new" "$root"
}

usable() {
    [ -f "$root/mesa-version" ] && [ -f "$libs/libvulkan_lvp.so" ] && [ -f "$root/lvp_icd.json" ] &&
        [ "$(cut -d. -f1 "$root/mesa-version")" -ge "$want" ]
}

if ! usable; then
    fetch
    printf '{"file_format_version": "1.0.1", "ICD": {"library_path": "%s", "api_version": "1.4.0"}}\n' \
        "$libs/libvulkan_lvp.so" >"$root/lvp_icd.json"
    usable || fail "the fetched lavapipe is Mesa $(cat "$root/mesa-version" 2>/dev/null), not >= $want"
fi

if [ "${1:-}" = --run ]; then
    shift
    [ $# -gt 0 ] || { echo "usage: scripts/fetch_lavapipe.sh [--run CMD ...]" >&2; exit 2; }
    export VK_DRIVER_FILES="$root/lvp_icd.json"
    exec "$root/usr/lib64/ld-linux-x86-64.so.2" --library-path "$libs:/usr/lib/x86_64-linux-gnu" "$@"
fi
echo "$root"
