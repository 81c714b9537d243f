"""Asynchronous steady-state genetic search: ``GeneticOracle`` and ``GeneticSearch``.

There is no generation barrier: a group that asks for a trial gets one at
once, a random configuration while its island's population is filling, a
child of the population afterwards (tournament selection, uniform crossover,
per-gene mutation). A completed trial joins its island's population; when
that overflows, the oldest member goes, except the ``elitism`` best, which
are never replaced (regularised evolution with elites). Islands (demes)
evolve apart: trial k belongs to island k mod ``islands``; every
``migration_interval`` completed trials each island sends a copy of its best
member to the next island (a ring).

Genes are hyperparameters: Int and Float mutate by a Gaussian step in the
unit cube (so log sampling is respected, through ``value_to_prob`` /
``prob_to_value``), Choice and Boolean are redrawn, Fixed never changes, and
only the hyperparameters active under the child's own values are set
(conditional scopes). The populations are saved with the oracle and rebuilt
from the trials in the order they ended, so a resumed search goes on as an
uninterrupted one would.
"""

from __future__ import annotations

import logging
import math
import zlib
from typing import Any

import keras_tuner as kt
import numpy as np
from keras_tuner.engine import hyperparameters as hp_module

from matex import _compat
from matex.hpo import _unit_cube

log = logging.getLogger(__name__)

_COMPLETED = kt.engine.trial.TrialStatus.COMPLETED
_RUNNING = kt.engine.trial.TrialStatus.RUNNING
_STOPPED = kt.engine.trial.TrialStatus.STOPPED
_TOURNAMENT = 3          # members drawn per tournament
_STEP = 0.1              # standard deviation of a numeric mutation, in the unit cube
_ATTEMPTS = 20           # children drawn before falling back to a random configuration


class GeneticOracle(kt.Oracle):
    """Steady-state genetic algorithm with elitism and islands.

    Args (beyond ``keras_tuner.Oracle``'s):
        population_size: members in all islands together (split evenly; each
            island needs at least two, and more than ``elitism``).
        mutation_rate: probability that each gene of a child mutates.
        crossover_rate: probability that a child mixes two parents (uniform
            crossover) rather than copying one.
        elitism: best members of each island that are never replaced.
        islands: populations evolving apart.
        migration_interval: completed trials between migrations.
    """

    def __init__(self, objective: kt.Objective | str | list | None = None, max_trials: int = 10,
                 population_size: int = 16, mutation_rate: float = 0.2,
                 crossover_rate: float = 0.5, elitism: int = 2, islands: int = 1,
                 migration_interval: int = 10, seed: int | None = None,
                 hyperparameters: kt.HyperParameters | None = None,
                 allow_new_entries: bool = True, tune_new_entries: bool = True,
                 max_retries_per_trial: int = 0, max_consecutive_failed_trials: int = 3) -> None:
        islands = int(islands)
        if islands < 1:
            raise ValueError("islands must be at least 1, got %r" % islands)
        sizes = [population_size // islands + (i < population_size % islands)
                 for i in range(islands)]
        if min(sizes) < 2 or min(sizes) <= elitism or elitism < 0:
            raise ValueError(
                "population_size=%d over %d island(s) gives islands of %s members: each needs "
                "at least 2 and more than elitism=%d" % (population_size, islands, sizes, elitism))
        for name, rate in (("mutation_rate", mutation_rate), ("crossover_rate", crossover_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError("%s must be in [0, 1], got %r" % (name, rate))
        if int(migration_interval) < 1:
            raise ValueError("migration_interval must be at least 1, got %r" % migration_interval)
        super().__init__(objective=objective, max_trials=max_trials,
                         hyperparameters=hyperparameters, tune_new_entries=tune_new_entries,
                         allow_new_entries=allow_new_entries, seed=seed,
                         max_retries_per_trial=max_retries_per_trial,
                         max_consecutive_failed_trials=max_consecutive_failed_trials)
        self.population_size = int(population_size)
        self.mutation_rate = float(mutation_rate)
        self.crossover_rate = float(crossover_rate)
        self.elitism = int(elitism)
        self.islands = islands
        self.migration_interval = int(migration_interval)
        self._sizes = sizes
        self._populations = [[] for _ in range(islands)]
        self._island_of = {}
        self._processed = set()
        self._completed = 0
        self.migrations = 0

    # ---- populations ------------------------------------------------------------------------

    @property
    def populations(self) -> list:
        """Each island's members (trial ids), oldest first; after taking in finished trials."""
        self._sync()
        return [list(p) for p in self._populations]

    def _loss(self, trial_id):
        """The minimised value of a completed trial (ties broken by age: older first)."""
        score = self.trials[trial_id].score
        return -score if self.objective.direction == "max" else score

    def _elites(self, members):
        return set(sorted(members, key=self._loss)[:self.elitism])

    def _admit(self, island, trial_id):
        """Add a member; if the island overflows, drop its oldest non-elite member."""
        members = self._populations[island]
        if trial_id in members:
            return
        members.append(trial_id)
        if len(members) > self._sizes[island]:
            elites = self._elites(members)
            oldest = next(m for m in members if m not in elites)
            members.remove(oldest)

    def _sync(self):
        """Take in the trials that ended since last time, in the order they ended."""
        for trial_id in self.end_order:
            if trial_id in self._processed or trial_id not in self.trials:
                continue
            self._processed.add(trial_id)
            trial = self.trials[trial_id]
            if trial.status != _COMPLETED or trial.score is None or not math.isfinite(trial.score):
                continue
            island = self._island_of.get(trial_id)
            if island is None:
                island = _number(trial_id) % self.islands
            self._admit(island, trial_id)
            self._completed += 1
            if self.islands > 1 and self._completed % self.migration_interval == 0:
                self._migrate()

    def _migrate(self):
        """Each island sends a copy of its best member to the next island (a ring)."""
        bests = [min(p, key=self._loss) if p else None for p in self._populations]
        for island, best in enumerate(bests):
            if best is not None:
                self._admit((island + 1) % self.islands, best)
        self.migrations += 1
        log.debug("GeneticOracle: migration %d after %d trials", self.migrations,
                  self._completed)

    # ---- proposals --------------------------------------------------------------------------

    def populate_space(self, trial_id: str) -> dict:
        self._sync()
        island = _number(trial_id) % self.islands
        self._island_of[trial_id] = island
        members = self._populations[island]
        pending = sum(1 for t in self.ongoing_trials.values()
                      if self._island_of.get(t.trial_id) == island)
        if len(members) < 2 or len(members) + pending < self._sizes[island]:
            return self._random()
        rng = np.random.default_rng([int(self.seed), _number(trial_id)])
        for _ in range(_ATTEMPTS):
            values = self._child(members, rng)
            if not _compat.oracle_has_tried(self, values):
                return {"status": _RUNNING, "values": values}
        log.info("GeneticOracle: %d children were all tried already; a random configuration",
                 _ATTEMPTS)
        return self._random()

    def _random(self):
        values = _compat.oracle_random_values(self)
        if values is None:
            return {"status": _STOPPED, "values": None}
        return {"status": _RUNNING, "values": values}

    def _tournament(self, members, rng, exclude=None):
        pool = [m for m in members if m != exclude] or list(members)
        drawn = rng.choice(len(pool), size=min(_TOURNAMENT, len(pool)), replace=False)
        return min((pool[i] for i in drawn), key=self._loss)

    def _child(self, members, rng):
        """A child's values: two parents by tournament, uniform crossover, mutation."""
        first = self._tournament(members, rng)
        second = self._tournament(members, rng, exclude=first)
        parents = [self.trials[first].hyperparameters.values,
                   self.trials[second].hyperparameters.values]
        cross = rng.random() < self.crossover_rate
        hps = hp_module.HyperParameters()
        for hp in self.hyperparameters.space:
            hps.merge([hp])
            if not hps.is_active(hp):
                continue
            if isinstance(hp, hp_module.Fixed):
                hps.values[hp.name] = hp.value
                continue
            order = [1, 0] if cross and rng.random() < 0.5 else [0, 1]
            value = next((parents[i][hp.name] for i in order if hp.name in parents[i]), None)
            if value is None:    # inactive in both parents: a gene neither carried
                value = hp.prob_to_value(float(_unit_cube.clip(rng.random())))
            elif rng.random() < self.mutation_rate:
                value = mutate(hp, value, rng)
            hps.values[hp.name] = value
        return hps.values

    # ---- saved state ------------------------------------------------------------------------

    def get_state(self) -> dict:
        self._sync()
        state = super().get_state()
        state.update({"population_size": self.population_size,
                      "mutation_rate": self.mutation_rate, "crossover_rate": self.crossover_rate,
                      "elitism": self.elitism, "islands": self.islands,
                      "migration_interval": self.migration_interval,
                      "populations": self._populations, "island_of": self._island_of,
                      "processed": sorted(self._processed), "completed": self._completed,
                      "migrations": self.migrations})
        return state

    def set_state(self, state: dict) -> None:
        super().set_state(state)
        for name in ("population_size", "mutation_rate", "crossover_rate", "elitism", "islands",
                     "migration_interval", "migrations"):
            setattr(self, name, state[name])
        self._sizes = [self.population_size // self.islands
                       + (i < self.population_size % self.islands) for i in range(self.islands)]
        self._populations = [list(p) for p in state["populations"]]
        self._island_of = dict(state["island_of"])
        self._processed = set(state["processed"])
        self._completed = state["completed"]


def mutate(hp, value, rng):
    """One gene's mutation: a Gaussian step in the unit cube (Int, Float), a redraw (others)."""
    if isinstance(hp, hp_module.Fixed):
        return hp.value
    if isinstance(hp, hp_module.Boolean):
        return not value
    if isinstance(hp, hp_module.Choice):
        others = [v for v in hp.values if v != value]
        return others[rng.integers(len(others))] if others else value
    prob = hp.value_to_prob(value)
    for attempt in range(5):
        step = rng.normal(0.0, _STEP * 2 ** attempt)
        moved = prob + step
        moved = -moved if moved < 0 else (2.0 - moved if moved > 1 else moved)   # reflect
        new = hp.prob_to_value(float(_unit_cube.clip(moved)))
        if new != value:
            return new
    return value


def _number(trial_id):
    """A trial's ordinal (Keras Tuner numbers trials '00', '01', ...)."""
    try:
        return int(trial_id)
    except (TypeError, ValueError):
        return zlib.crc32(str(trial_id).encode())


class GeneticSearch(kt.Tuner):
    """A Keras Tuner tuner driven by ``GeneticOracle`` (same arguments as Keras Tuner's tuners,
    plus the genetic ones)."""

    def __init__(self, hypermodel: kt.HyperModel | Any = None,
                 objective: kt.Objective | str | list | None = None, max_trials: int = 10,
                 population_size: int = 16, mutation_rate: float = 0.2,
                 crossover_rate: float = 0.5, elitism: int = 2, islands: int = 1,
                 migration_interval: int = 10, seed: int | None = None,
                 hyperparameters: kt.HyperParameters | None = None,
                 tune_new_entries: bool = True, allow_new_entries: bool = True,
                 max_retries_per_trial: int = 0, max_consecutive_failed_trials: int = 3,
                 **kwargs: Any) -> None:
        oracle = GeneticOracle(
            objective=objective, max_trials=max_trials, population_size=population_size,
            mutation_rate=mutation_rate, crossover_rate=crossover_rate, elitism=elitism,
            islands=islands, migration_interval=migration_interval, seed=seed,
            hyperparameters=hyperparameters, tune_new_entries=tune_new_entries,
            allow_new_entries=allow_new_entries, max_retries_per_trial=max_retries_per_trial,
            max_consecutive_failed_trials=max_consecutive_failed_trials)
        super().__init__(oracle=oracle, hypermodel=hypermodel, **kwargs)
