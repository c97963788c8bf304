#!/usr/bin/env bash
# The wheel folder that scripts/ci/gpu_check.sh installs from on a GPU node without network access.
# Run it beforehand on a machine that reaches the package index, then bring the folder to the node
# with the working tree (docs/gpu.md):
#   bash scripts/ci/gpu_wheels.sh gpu_wheels     # DIR, default ./gpu_wheels (gpu_check.sh's default)
# It downloads exactly scripts/ci/gpu_lane_requirements.txt (Hydra, OmegaConf, the ANTLR runtime
# they pin and torchao for precision.float8: what the CUDA lane needs beyond a GPU image's Python),
# without dependencies; a package published only as an sdist (the ANTLR 4.9.3 runtime) is built
# into a wheel here. It also adds setuptools, which gpu_check.sh uses only where the node's own is
# missing or too old to install the project in place (PEP 660). Every wheel must be pure Python
# (py3-none-any): the folder then suits any Python 3 and any CPU, whatever this machine is. pip is
# asked for pure wheels only, so a package that publishes compiled wheels beside its pure one
# (torchao: cp310-abi3 manylinux_2_28, with kernels the lane never calls) gives the pure one; a
# package whose wheels are all compiled stops the script. The *.whl files in DIR are replaced. It
# ends by listing the wheels and the folder's total size, which must leave room for the working
# tree in what can be brought to the node.
#   PYTHON=python3.12 ...                 # the pip that downloads (default python3)
#   GPU_WHEELS_PYTHON_VERSION=3.11 ...    # the node's Python, for Requires-Python (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-gpu_wheels}
PYTHON=${PYTHON:-python3}
PY_VERSION=${GPU_WHEELS_PYTHON_VERSION:-3.12}
REQUIREMENTS=scripts/ci/gpu_lane_requirements.txt
# The project's own install on the node: PEP 660 editable installs without the wheel package.
# Below 82, as torch 2.11 requires (its Requires-Dist): where the node's setuptools is too old,
# this one is installed beside the node's torch, and pip warns of the conflict otherwise.
SETUPTOOLS="setuptools>=70.1,<82"

mkdir -p "$DIR"
rm -f "$DIR"/*.whl
build=$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels.XXXXXX")
trap 'rm -rf "$build"' EXIT

requirements=()
while IFS= read -r line; do
    line=${line%%#*}
    line=$(echo "$line" | xargs)
    [ -n "$line" ] && requirements+=("$line")
done <"$REQUIREMENTS"
requirements+=("$SETUPTOOLS")

for requirement in "${requirements[@]}"; do
    # Tags py3*-none-any only (implementation py, no ABI, platform any): pip would otherwise prefer
    # a compiled wheel for this machine's platform over the pure one.
    if "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version "$PY_VERSION" --implementation py --abi none --platform any \
        --dest "$DIR" "$requirement" 2>"$build/download.log"; then
        echo "gpu_wheels: $requirement: downloaded"
        continue
    fi
    # No pure wheel. Where the node's platform has a compiled one, the package is compiled: stop
    # here, rather than build its sdist into a wheel for this machine alone.
    if "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version "$PY_VERSION" --platform manylinux_2_28_x86_64 --implementation cp \
        --dest "$build/compiled" "$requirement" 2>/dev/null; then
        echo "gpu_wheels: $requirement: compiled wheels only ($(ls "$build/compiled")), not pure" \
            "Python, so not for every node" >&2
        exit 1
    fi
    # No wheel on the index: build one from this package's sdist. --no-binary names it alone:
    # its build backend (setuptools, wheel) comes from the index as wheels, not built from source.
    name=$(echo "$requirement" | sed 's/[][<>=!~; ].*//')
    if ! "$PYTHON" -m pip wheel --quiet --no-deps --no-binary "$name" --wheel-dir "$build/wheel" \
        "$requirement" 2>"$build/wheel.log"; then
        cat "$build/download.log" "$build/wheel.log" >&2
        echo "gpu_wheels: $requirement: neither a wheel nor a buildable sdist on the index" >&2
        exit 1
    fi
    mv "$build"/wheel/*.whl "$DIR"/
    echo "gpu_wheels: $requirement: built from its sdist"
done

impure=$(find "$DIR" -maxdepth 1 -name '*.whl' ! -name '*-none-any.whl' -printf '%f ')
if [ -n "$impure" ]; then
    echo "gpu_wheels: not pure Python, so not for every node: $impure" >&2
    exit 1
fi
ls -l "$DIR"/*.whl
bytes=$(cat "$DIR"/*.whl | wc -c)
# The whole folder too (du: blocks on disk), in case something besides the wheels lies there.
echo "gpu_wheels: $(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l) wheels, $((bytes / 1024)) KiB" \
    "($(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }') MiB) in all; the folder $DIR:" \
    "$(du -sk "$DIR" | cut -f1) KiB on disk (with the working tree, what is brought to the node" \
    "must stay under 64 MiB)"
