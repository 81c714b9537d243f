#!/bin/sh
# A Python environment whose mpi4py is built from source against a system MPI.
#
#   sysmpi_env.sh PYTHON VENV [MPICC]
#
# PYTHON: the project's interpreter (.venv/bin/python); VENV: the directory to
# make; MPICC: the system MPI's compiler wrapper (default /usr/bin/mpicc,
# Debian's Open MPI: apt-get install openmpi-bin libopenmpi-dev).
#
# VENV gets mpi4py built with that MPICC (the same version as PYTHON's) and
# sees PYTHON's other packages (TensorFlow, Keras, MaTEx...) through a .pth
# file placed after its own site-packages, so its mpi4py wins. The built wheel
# is cached in ${MATEX_SYSMPI_CACHE:-~/.cache/matex/sysmpi}/<key>, the key
# covering the mpi4py and Python versions and the MPI's compile line, so later
# runs (fresh clones too) only install it (seconds; the build takes minutes).
set -eu

[ $# -ge 2 ] || { sed -n '2,16p' "$0" >&2; exit 2; }
python=$1 venv=$2 mpicc=${3:-/usr/bin/mpicc}
[ -x "$mpicc" ] || { echo "sysmpi_env.sh: no MPI compiler wrapper at $mpicc" >&2; exit 3; }

version=$("$python" -c 'import mpi4py; print(mpi4py.__version__)')
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
key=$({ echo "$version"; "$python" -c 'import sys; print(sys.version)'; "$mpicc" -show; } \
      | sha256sum | cut -c1-16)
cache=${MATEX_SYSMPI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/matex/sysmpi}/$key

stamp="$venv/.sysmpi-$key"
if [ ! -e "$stamp" ]; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    if ! ls "$cache"/mpi4py-*.whl >/dev/null 2>&1; then
        # built by VENV's interpreter: the project's prefix holds the embedded
        # MPI's headers, which mpi4py's build would otherwise pick up
        echo "sysmpi_env.sh: building mpi4py $version against $mpicc (minutes, once)" >&2
        tmp="$cache.tmp.$$"
        rm -rf "$tmp" && mkdir -p "$tmp"
        MPICC=$mpicc "$venv/bin/python" -m pip wheel -q --no-deps --no-binary mpi4py \
            --no-cache-dir -w "$tmp" "mpi4py==$version"
        rm -rf "$cache" && mv "$tmp" "$cache"
    fi
    "$venv/bin/python" -m pip install -q --no-deps --no-index "$cache"/mpi4py-*.whl
    vsite=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$site')" > "$vsite/zz_matex_project.pth"
    touch "$stamp"
fi
echo "$venv/bin/python"
