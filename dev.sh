#!/usr/bin/env bash
# The README's two set-up commands:
#   ./dev.sh train   install flowgrad into .venv and train models/mlp.flow on the digits data
#   ./dev.sh test    also install lavapipe (CPU Vulkan), glslc and the Vulkan validation layers,
#                    fetch Debian trixie's glslc for the shaders that need it (scripts/fetch_glslc.sh)
#                    and trixie-backports' lavapipe (scripts/fetch_lavapipe.sh), PyTorch's CPU wheel
#                    (the reference tests compare with it), then run the whole test suite, and its
#                    cooperative-matrix tests again on that lavapipe
# Extra arguments go to `flowgrad train` / `pytest`.
set -euo pipefail
cd "$(dirname "$0")"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {  # install the Debian packages that are missing, if any
    local missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "dev.sh: installing Debian packages: ${missing[*]}" >&2
    as_root apt-get update -q >/dev/null
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
}

venv() {  # .venv with flowgrad (editable) and its dev extra; reinstalled when pyproject.toml changes
    python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv
    [ -x .venv/bin/python ] || python3 -m venv .venv
    local stamp=.venv/.flowgrad-installed want
    want=$(sha256sum pyproject.toml | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        .venv/bin/python -m pip install -q --upgrade pip
        .venv/bin/python -m pip install -q -e ".[dev]"
        echo "$want" >"$stamp"
    fi
}

# PyTorch for the tests that compare with it, installed here rather than in the dev extra: the
# dev extra is what a developer's `pip install -e '.[dev]'` takes too, on a GPU machine whose CUDA
# torch it must not replace, and `./dev.sh train` needs no torch, so its install stays light.
# The tests run torch on the CPU: the exact pin takes the local 2.13.0+cpu wheel that pip's
# find-links offer on the CI machine, where a bare `torch` would fetch PyPI's CUDA build (several
# GB). Elsewhere, PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu gets the CPU wheel
# (pip prefers 2.13.0+cpu to 2.13.0); it is not passed here, as pip retries every package on an
# index it cannot reach, for minutes, where that index is offline.
TORCH_VERSION=2.13.0

torch_cpu() {
    .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$TORCH_VERSION')" \
        2>/dev/null && return 0
    echo "dev.sh: installing PyTorch $TORCH_VERSION for the reference tests" >&2
    .venv/bin/python -m pip install -q "torch==$TORCH_VERSION"
}

COOP_TESTS="tests/test_attention_coop.py tests/test_mixed_precision.py tests/test_graph_path_attention.py
            tests/test_matmul_kernels.py::test_coop_kernel_when_offered tests/test_matmul_coop_epilogue.py
            tests/test_matmul_stream.py tests/test_split_barriers.py"

names_tests() {  # whether pytest's arguments name tests (a file, a folder, -k, -m): then one pass runs just those
    local arg
    for arg in "$@"; do
        case "$arg" in -k|-m|-k*|-m*|--deselect*) return 0 ;; esac
        [ -e "${arg%%::*}" ] && return 0
    done
    return 1
}

case "${1:-}" in
    train)
        shift
        venv
        .venv/bin/flowgrad train models/mlp.flow --out runs/mlp --overwrite "$@"
        ;;
    test)
        shift
        apt_install glslc mesa-vulkan-drivers vulkan-validationlayers libvulkan1
        # the cooperative-matrix-2 shaders need a newer glslc: Debian trixie's, unpacked privately
        scripts/fetch_glslc.sh >/dev/null
        # ... and the bf16 cooperative-matrix shaders Debian sid's, pinned to the version they were built with
        scripts/fetch_glslc.sh sid >/dev/null
        # and the cooperative-matrix attention kernels a newer lavapipe (Mesa 26, trixie-backports)
        scripts/fetch_lavapipe.sh >/dev/null
        venv
        torch_cpu
        set +e
        .venv/bin/python -m pytest "$@"
        rc=$?
        if ! names_tests "$@"; then
            echo "dev.sh: the cooperative-matrix tests again, on Mesa 26's lavapipe" >&2
            FLOWGRAD_TEST_COOP=1 scripts/fetch_lavapipe.sh --run .venv/bin/python -m pytest "$@" $COOP_TESTS
            coop_rc=$?
            [ $rc -ne 0 ] || rc=$coop_rc
        fi
        set -e
        if [ $rc -eq 5 ]; then echo "dev.sh: pytest collected no tests; that is a failure" >&2; exit 1; fi
        exit $rc
        ;;
    *)
        echo "usage: ./dev.sh train|test [args...]" >&2
        exit 2
        ;;
esac
