"""Distributed hyperparameter search and ensembles (``matex.hpo``).

Three ways in:

* an unmodified Keras Tuner script, run with ``matexrun --ranks-per-trial K``
  (or ``MATEX_RANKS_PER_TRIAL=K``): the ranks split into groups of K, each
  group trains its own trials data-parallel, one rank owns the oracle;
* MaTEx's own oracles with any Keras Tuner tuner: ``GeneticOracle``,
  ``LazyBayesianOracle`` (a GP with the lazy Cholesky extension, ``LazyGP``),
  and the tuners built on them, ``GeneticSearch`` and ``LazyBayesianSearch``;
* a function API for objectives that are not Keras models: ``minimize``.

``ensemble(models)`` averages the outputs of the best models.
"""

__all__ = [
    "LazyGP", "GeneticOracle", "LazyBayesianOracle", "GeneticSearch", "LazyBayesianSearch",
    "minimize", "ensemble",
]

_LAZY = {
    "LazyGP": "matex.hpo._lazy_gp",
    "GeneticOracle": "matex.hpo._genetic",
    "GeneticSearch": "matex.hpo._genetic",
    "LazyBayesianOracle": "matex.hpo._bayesian",
    "LazyBayesianSearch": "matex.hpo._bayesian",
    "minimize": "matex.hpo._minimize",
    "ensemble": "matex.hpo._ensemble",
}


def __getattr__(name):
    # keras_tuner, TensorFlow and MPI are imported on first use of a name
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError("module 'matex.hpo' has no attribute %r" % name)
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
