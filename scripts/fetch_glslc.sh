#!/usr/bin/env bash
# Fetch a newer glslc into a private folder, without touching the system's apt configuration:
# apt reads a sources file of its own with its own lists, downloads the packages, and dpkg -x
# unpacks them; the compiler then runs through that release's own loader and libraries.
#
#   scripts/fetch_glslc.sh          # Debian trixie's (shaderc 2025.2, glslang 15.1): GL_NV_cooperative_matrix2
#   scripts/fetch_glslc.sh sid      # Debian sid's, pinned to shaderc 2026.4-1 (glslang 16.4): GL_EXT_bfloat16
#
# Fetches if missing, and prints the folder: $FLOWGRAD_GLSLC_ROOT (trixie) or
# $FLOWGRAD_GLSLC_SID_ROOT (sid), default ~/.cache/flowgrad/glslc-trixie or glslc-sid
# (scripts/build_shaders.py looks there). trixie-backports has no glslc, so the bf16 shaders'
# compiler comes from sid, pinned to the version the shipped SPIR-V was built with (a newer one
# would build other bytes; scripts/build_shaders.py's BF16_GLSLC_VERSION names the same version).
# Needs network access to deb.debian.org and Debian's apt.
set -euo pipefail

suite="${1:-trixie}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/flowgrad"
case "$suite" in
    trixie)
        root="${FLOWGRAD_GLSLC_ROOT:-$cache/glslc-trixie}"
        want="shaderc 2025.2"
        packages=(glslc libshaderc1 libc6 libstdc++6 libgcc-s1)
        needed_for="the cooperative-matrix-2 shaders need glslc >= 2025.2 (glslang >= 15)"
        env_name=FLOWGRAD_GLSLC_2025 ;;
    sid)
        root="${FLOWGRAD_GLSLC_SID_ROOT:-$cache/glslc-sid}"
        pin="2026.4-1"
        want="shaderc $pin"
        packages=("glslc=$pin" "libshaderc1=$pin" libc6 libstdc++6 libgcc-s1)
        needed_for="the bf16 cooperative-matrix shaders need glslc $pin (glslang 16.4, GL_EXT_bfloat16)"
        env_name=FLOWGRAD_GLSLC_BF16 ;;
    *)
        echo "fetch_glslc.sh: unknown release '$suite' (trixie or sid)" >&2
        exit 2 ;;
esac

glslc_runs() {
    local version
    version=$("$root/usr/lib64/ld-linux-x86-64.so.2" --library-path "$root/usr/lib/x86_64-linux-gnu" \
        "$root/usr/bin/glslc" --version 2>/dev/null) || return 1
    [[ "$version" == *"$want"* ]]
}
if [ -x "$root/usr/bin/glslc" ] && glslc_runs; then
    echo "$root"
    exit 0
fi

fail() {
    echo "fetch_glslc.sh: $*" >&2
    echo "fetch_glslc.sh: $needed_for: either allow access to deb.debian.org (Debian $suite's glslc is" \
         "fetched from there), or install such a glslc and set $env_name=/path/to/glslc" >&2
    exit 1
}
command -v apt-get >/dev/null && command -v dpkg >/dev/null || fail "apt-get and dpkg are needed to fetch it"
[ "$(dpkg --print-architecture)" = amd64 ] || fail "only amd64 is fetched (this is $(dpkg --print-architecture))"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
echo "deb http://deb.debian.org/debian $suite main" >"$work/sources.list"
apt_opts=(-q -o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o Acquire::Retries=3
          -o APT::Sandbox::User="$(id -un)")
apt-get "${apt_opts[@]}" update >"$work/log" 2>&1 || { cat "$work/log" >&2; fail "apt-get update of $suite failed"; }
if ! (cd "$work/debs" && apt-get "${apt_opts[@]}" download "${packages[@]}" >>"$work/log" 2>&1); then
    cat "$work/log" >&2
    if [ "$suite" = sid ]; then
        fail "downloading sid's glslc $pin failed: sid may have moved on from it. Fetch glslc_$pin and" \
             "libshaderc1_$pin from snapshot.debian.org into a folder and point FLOWGRAD_GLSLC_BF16 at its" \
             "glslc, or move the pin (here and scripts/build_shaders.py's BF16_GLSLC_VERSION) and commit" \
             "the bf16 SPIR-V the new version builds"
    fi
    fail "downloading $suite's glslc failed"
fi
rm -rf "$root.new"
mkdir -p "$root.new"
for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$root.new"; done
rm -rf "$root"
mv "$root.new" "$root"
glslc_runs || fail "the fetched glslc does not run (expected $want)"
echo "$root"
