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

from matex import _compat, _lazy

_LAZY = {
    "LazyGP": "matex.hpo._lazy_gp",
    "GeneticOracle": "matex.hpo._genetic",
    "GeneticSearch": "matex.hpo._genetic",
    "LazyBayesianOracle": "matex.hpo._bayesian",
    "LazyBayesianSearch": "matex.hpo._bayesian",
    "minimize": "matex.hpo._minimize",
    "ensemble": "matex.hpo._ensemble",
}


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:   # type checkers and IDEs see the lazy names' own signatures
    from matex.hpo._bayesian import LazyBayesianOracle, LazyBayesianSearch
    from matex.hpo._ensemble import ensemble
    from matex.hpo._genetic import GeneticOracle, GeneticSearch
    from matex.hpo._lazy_gp import LazyGP
    from matex.hpo._minimize import minimize

# keras_tuner, TensorFlow and MPI are imported on first use of a name
_resolve, __dir__ = _lazy.attach(__name__, _LAZY, __all__)


def __getattr__(name: str) -> object:
    # Keras Tuner and scipy come with the [hpo] extra: a missing one is named with it
    if name in _LAZY and name != "ensemble":   # ensemble needs Keras only
        _compat.require_extra(("keras_tuner", "scipy"), "hpo", "matex.hpo." + name)
    return _resolve(name)
