"""Hyperparameter values <-> points of the unit cube, as Keras Tuner's own Bayesian oracle does.

Every tunable hyperparameter (all but ``Fixed``) is one coordinate in [0, 1]:
``hp.value_to_prob`` / ``hp.prob_to_value`` respect log sampling, Int steps and
Choice bins. A hyperparameter inactive in a trial (its conditional scope not
taken) or added to the space after the trial sits at its default's
coordinate. Going back, only the hyperparameters active under the values
chosen so far are set, in the order of the space, so conditional scopes come
out as Keras Tuner itself would build them.
"""

import numpy as np
from keras_tuner.engine import hyperparameters as hp_module

# prob_to_value(1.0) can fall outside the range (a log-sampled Int gives max + 1)
_TOP = 1.0 - 1e-9


def tunable(space) -> list:
    """The hyperparameters of ``space`` (a list, ``HyperParameters.space``) that are not Fixed."""
    return [hp for hp in space if not isinstance(hp, hp_module.Fixed)]


def names(space) -> tuple:
    """Identity of the coordinates: the tunable hyperparameters' names, in order."""
    return tuple(hp.name for hp in tunable(space))


def clip(prob):
    """Coordinates clipped into the part of [0, 1] every ``prob_to_value`` maps into range."""
    return np.clip(prob, 0.0, _TOP)


def to_vector(space, hyperparameters) -> np.ndarray:
    """A trial's ``HyperParameters`` -> its point in [0, 1]^d (d = tunable hps of ``space``)."""
    vector = []
    for hp in tunable(space):
        if hyperparameters.is_active(hp) and hp.name in hyperparameters.values:
            value = hyperparameters.values[hp.name]
        else:
            value = hp.default
        vector.append(hp.value_to_prob(value))
    return clip(np.array(vector, dtype=float))


def to_values(hyperparameters, vector) -> dict:
    """A point of [0, 1]^d -> values of the active hyperparameters (conditions respected)."""
    hps = hp_module.HyperParameters()
    vector = clip(np.asarray(vector, float))
    index = 0
    for hp in hyperparameters.space:
        hps.merge([hp])
        if isinstance(hp, hp_module.Fixed):
            value = hp.value
        else:
            value = hp.prob_to_value(float(vector[index]))
            index += 1
        if hps.is_active(hp):
            hps.values[hp.name] = value
    return hps.values
