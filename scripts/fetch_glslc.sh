#!/usr/bin/env bash
# Fetch a glslc new enough for GL_NV_cooperative_matrix2 (Debian trixie's: shaderc 2025.2,
# glslang 15.1) into a private folder, without touching the system's apt configuration:
# apt reads a sources file of its own with its own lists, downloads the packages, and
# dpkg -x unpacks them; the compiler then runs through trixie's own loader and libraries.
#
#   scripts/fetch_glslc.sh          # fetch if missing; print the folder
#
# The folder is $FLOWGRAD_GLSLC_ROOT, default ~/.cache/flowgrad/glslc-trixie (scripts/build_shaders.py
# looks there). Needs network access to deb.debian.org and Debian's apt.
set -euo pipefail

root="${FLOWGRAD_GLSLC_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/flowgrad/glslc-trixie}"
want="2025.2"
glslc_runs() {
    local version
    version=$("$root/usr/lib64/ld-linux-x86-64.so.2" --library-path "$root/usr/lib/x86_64-linux-gnu" \
        "$root/usr/bin/glslc" --version 2>/dev/null) || return 1
    [[ "$version" == *"shaderc $want"* ]]
}
if [ -x "$root/usr/bin/glslc" ] && glslc_runs; then
    echo "$root"
    exit 0
fi

fail() {
    echo "fetch_glslc.sh: $1" >&2
    echo "fetch_glslc.sh: the cooperative-matrix-2 shaders need glslc >= $want (glslang >= 15): either allow" \
         "access to deb.debian.org (Debian trixie's glslc is fetched from there), or install such a glslc and" \
         "set FLOWGRAD_GLSLC_2025=/path/to/glslc" >&2
    exit 1
}
command -v apt-get >/dev/null && command -v dpkg >/dev/null || fail "apt-get and dpkg are needed to fetch it"
[ "$(dpkg --print-architecture)" = amd64 ] || fail "only amd64 is fetched (this is $(dpkg --print-architecture))"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
echo "deb http://deb.debian.org/debian trixie main" >"$work/sources.list"
apt_opts=(-q -o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o Acquire::Retries=3
          -o APT::Sandbox::User="$(id -un)")
apt-get "${apt_opts[@]}" update >"$work/log" 2>&1 || { cat "$work/log" >&2; fail "apt-get update of trixie failed"; }
(cd "$work/debs" && apt-get "${apt_opts[@]}" download glslc libshaderc1 libc6 libstdc++6 libgcc-s1 \
    >>"$work/log" 2>&1) || { cat "$work/log" >&2; fail "downloading trixie's glslc failed"; }
rm -rf "$root.new"
mkdir -p "$root.new"
for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$root.new"; done
rm -rf "$root"
mv "$root.new" "$root"
glslc_runs || fail "the fetched glslc does not run (expected shaderc $want)"
echo "$root"
