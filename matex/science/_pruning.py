"""YinYang sample pruning: samples the model has learned skip the next epochs.

A sample that the model classifies correctly with a margin above ``margin``
(or whose loss is below ``loss_threshold``) is *learned* and left out of
the following epochs; every ``full_pass_every`` epochs one epoch trains on
all samples again and re-scores them, so samples the model forgot come back.

Where the samples live: each rank keeps its own block of the training set
(global arrays are cut into contiguous blocks, as ``fit`` cuts them; a
``matex.readers.DataSet`` gives its rank's shard, ``ds.training_data`` /
``ds.training_labels``, held in memory). A sample never moves between ranks.

One epoch, identical arithmetic on every rank (no message needed):

- rank r's candidates are its samples not learned (all in a full pass),
  shuffled from ``(seed, epoch, r)``; ``n_r`` of them;
- every rank takes ``S = ceil(max_r n_r / b)`` steps (``b`` = the global
  batch / ranks), so steps are equal on all ranks; rank r spreads its ``n_r``
  samples over the S steps (sizes differ by at most one). Every candidate
  is trained on exactly once per epoch: nothing is dropped, nothing repeated.
- ranks' batches differ in size, so each batch carries sample weights that
  make the averaged gradient the mean over the step's global batch (with
  ``DistributedOptimizer``'s plain average: ``rows_r * ranks / rows_all``;
  under ``import matex.keras``, whose ``fit`` weights ranks by row count:
  ``rows_all_padded / rows_all``). A rank with no sample left for a step
  gets one padding row of weight 0 (not counted as seen).
- if no candidate is left anywhere, the epoch is a full pass; so is the
  first epoch of each ``fit`` call (Keras fixes the step count of an input
  without a known length from the first epoch of a ``fit`` and would cut a
  longer later epoch short).

Scoring: at the end of each epoch every rank scores the samples it trained
on in one forward pass (``model(x, training=False)`` in batches of
``score_batch_size``; about a third of the training step's compute on those
samples), then one allgather of (sample ids, learned flags) over MaTEx's
control communicator gives every rank the same global flags. Samples left
out are not re-scored until the next full pass.

Reported: ``history`` (per epoch: samples trained, total, fraction, full
pass or not), ``logs["kept_fraction"]`` in ``fit``'s History, and one line
per epoch on rank 0.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from matex import _batch_slicing, _runtime


def _say(message: str) -> None:
    if _runtime.rank() == 0:
        print(message, flush=True)


class SamplePruning(keras.callbacks.Callback):
    """Keras callback + data source: drop learned samples from the next epochs.

    Args:
      data: ``(x, y)`` global arrays (the same on every rank; rank r uses its
        contiguous block), or a ``matex.readers.DataSet`` (its rank's shard).
        ``x`` one array (one model input); ``y`` integer class labels for the
        margin criterion, any target for the loss criterion.
      batch_size: the GLOBAL batch (all ranks together); must divide by the
        number of ranks.
      margin: learned = correct and (score of the true class - best other
        score) > ``margin`` (>= 0; scores are the model's outputs: logits or
        probabilities).
      loss_threshold: learned = per-sample loss < ``loss_threshold`` (> 0),
        with the compiled loss. Give exactly one of ``margin`` and
        ``loss_threshold``.
      full_pass_every: every this many epochs (>= 1; epoch 0, K, 2K, ...)
        all samples are trained on and re-scored.
      seed: the shuffles' seed (each epoch, each rank: ``(seed, epoch, rank)``).
      verbose: one line per epoch on rank 0.

    Use: ``model.fit(p.dataset(), epochs=..., callbacks=[p])``.
    """

    def __init__(self, data: Any, batch_size: int, margin: float | None = None,
                 loss_threshold: float | None = None, full_pass_every: int = 4, seed: int = 0,
                 score_batch_size: int = 1024, verbose: bool = True) -> None:
        super().__init__()
        if (margin is None) == (loss_threshold is None):
            raise ValueError("SamplePruning: give exactly one of margin= and loss_threshold=")
        if margin is not None and not (np.isfinite(margin) and margin >= 0):
            raise ValueError("SamplePruning: margin must be a finite number >= 0, got %r"
                             % (margin,))
        if loss_threshold is not None and not (np.isfinite(loss_threshold)
                                               and loss_threshold > 0):
            raise ValueError("SamplePruning: loss_threshold must be a finite number > 0, got %r"
                             % (loss_threshold,))
        if int(full_pass_every) != full_pass_every or full_pass_every < 1:
            raise ValueError("SamplePruning: full_pass_every must be an integer >= 1, got %r"
                             % (full_pass_every,))
        size = _runtime.size()
        if int(batch_size) != batch_size or batch_size < size or batch_size % size:
            raise ValueError("SamplePruning: batch_size (the global batch) must be a multiple "
                             "of the %d ranks, got %r" % (size, batch_size))
        self.margin, self.loss_threshold = margin, loss_threshold
        self.full_pass_every, self.seed = int(full_pass_every), int(seed)
        self.per_rank_batch = int(batch_size) // size
        self.score_batch_size, self.verbose = int(score_batch_size), bool(verbose)
        self.x, self.y, self.offset, self.counts = self._take(data)
        self.num_samples = int(sum(self.counts))
        if self.num_samples < int(batch_size):
            raise ValueError("SamplePruning: %d samples are fewer than one global batch (%d)"
                             % (self.num_samples, batch_size))
        self.learned = np.zeros(self.num_samples, bool)    # global, identical on every rank
        self.history = []
        self.row_weighted = False      # set from the model: matex.keras's fit weights by rows
        self._epoch = 0                # the epoch the next iteration of dataset() serves
        self._served = None            # (epoch, global ids trained on by this rank)
        self._loss_fn = None
        self._full_at = 0              # first epoch of a fit: a full pass (on_train_begin)

    @staticmethod
    def _take(data):
        """This rank's (x, y), its first global id, and every rank's sample count."""
        from matex.readers import DataSet

        if isinstance(data, DataSet):
            x, y = np.asarray(data.training_data), data.training_labels
            if y is None:
                raise ValueError("SamplePruning: the DataSet has no labels")
            y = np.asarray(y)
        else:
            try:
                x, y = data
            except (TypeError, ValueError):
                raise ValueError("SamplePruning: data must be (x, y) arrays or a "
                                 "matex.readers.DataSet") from None
            x, y = np.asarray(x), np.asarray(y)
            if len(x) != len(y):
                raise ValueError("SamplePruning: x has %d rows, y %d" % (len(x), len(y)))
            lo, hi = _batch_slicing.slice_bounds(len(x), _runtime.rank(), _runtime.size())
            x, y = x[lo:hi], y[lo:hi]
        counts = _runtime.control().allgather(len(x))
        offset = int(sum(counts[:_runtime.rank()]))
        return x, y, offset, [int(c) for c in counts]

    # -- the epoch plan (the same arithmetic on every rank) ----------------------

    def is_full_pass(self, epoch: int) -> bool:
        """Epochs 0, K, 2K, ..., the first epoch of each ``fit``, and when nothing is left."""
        return (epoch % self.full_pass_every == 0 or epoch == self._full_at
                or bool(self.learned.all()))

    def _candidates(self, rank: int, epoch: int) -> np.ndarray:
        """Rank ``rank``'s global ids trained on in ``epoch``, in training order."""
        first = int(sum(self.counts[:rank]))
        ids = np.arange(first, first + self.counts[rank])
        if not self.is_full_pass(epoch):
            ids = ids[~self.learned[first:first + self.counts[rank]]]
        rng = np.random.default_rng([self.seed, int(epoch), int(rank)])
        return rng.permutation(ids)

    def plan(self, epoch: int) -> tuple:
        """``(steps, this rank's batches as lists of global ids, weights per batch)``."""
        sizes = [len(self._candidates(r, epoch)) for r in range(_runtime.size())]
        steps = -(-max(sizes) // self.per_rank_batch)
        mine = self._candidates(_runtime.rank(), epoch)

        def cuts(n):      # n samples over `steps` batches, sizes differing by at most one
            return [n // steps + (1 if j < n % steps else 0) for j in range(steps)]

        per_rank = [cuts(n) for n in sizes]
        batches, weights, start = [], [], 0
        for j, rows in enumerate(cuts(len(mine))):
            real = [per_rank[r][j] for r in range(_runtime.size())]
            padded = [max(c, 1) for c in real]
            batch = mine[start:start + rows]
            start += rows
            if self.row_weighted:
                w = sum(padded) / sum(real)
            else:
                w = padded[_runtime.rank()] * _runtime.size() / sum(real)
            weight = np.full(max(rows, 1), w, np.float32)
            if rows == 0:          # a padding row, weight 0
                batch = np.array([self.offset], np.int64)
                weight[:] = 0.0
            batches.append(batch)
            weights.append(weight)
        return steps, batches, weights

    def kept_fraction(self, epoch: int) -> float:
        """Fraction of all samples trained on in ``epoch`` (from the current flags)."""
        if self.is_full_pass(epoch):
            return 1.0
        return float((~self.learned).sum()) / self.num_samples

    # -- data ------------------------------------------------------------------------

    def _generate(self):
        epoch = self._epoch
        self._epoch += 1
        _, batches, weights = self.plan(epoch)
        served = [b for b, w in zip(batches, weights) if w[0] > 0]   # not the padding rows
        self._served = (epoch, np.concatenate(served) if served else np.zeros(0, np.int64))
        kept = self.kept_fraction(epoch)
        self.history.append({"epoch": epoch, "kept": int(round(kept * self.num_samples)),
                             "total": self.num_samples, "fraction": kept,
                             "full_pass": self.is_full_pass(epoch), "steps": len(batches)})
        for batch, weight in zip(batches, weights):
            local = batch - self.offset
            yield self.x[local], self.y[local], weight

    def dataset(self) -> tf.data.Dataset:
        """This rank's batches ``(x, y, sample_weight)``; each iteration is the next epoch.

        Marked as sharded (``fit`` under ``matex.keras`` leaves it alone).
        Its length changes from epoch to epoch (unknown cardinality): do not
        pass ``steps_per_epoch``.
        """
        x_spec = tf.TensorSpec((None,) + self.x.shape[1:], tf.as_dtype(self.x.dtype))
        y_spec = tf.TensorSpec((None,) + self.y.shape[1:], tf.as_dtype(self.y.dtype))
        w_spec = tf.TensorSpec((None,), tf.float32)
        ds = tf.data.Dataset.from_generator(self._generate,
                                            output_signature=(x_spec, y_spec, w_spec))
        return _batch_slicing.mark_sharded(ds.prefetch(2))

    # -- scoring ------------------------------------------------------------------------

    def _per_sample_loss(self, y, out):
        if self._loss_fn is None:
            loss = self.model.loss
            if isinstance(loss, keras.losses.Loss):
                config = dict(loss.get_config(), reduction=None)
                self._loss_fn = type(loss).from_config(config)
            elif callable(loss) or isinstance(loss, str):
                self._loss_fn = keras.losses.get(loss)
            else:
                raise ValueError("SamplePruning(loss_threshold=...) needs one compiled loss, "
                                 "got %r" % (loss,))
        return np.asarray(self._loss_fn(y, out)).reshape(len(y), -1).mean(axis=1)

    def score(self, ids: np.ndarray) -> np.ndarray:
        """Whether each of this rank's samples ``ids`` (global) is learned, by the current model."""
        flags = np.zeros(len(ids), bool)
        for start in range(0, len(ids), self.score_batch_size):
            local = ids[start:start + self.score_batch_size] - self.offset
            out = np.asarray(self.model(self.x[local], training=False), np.float64)
            y = self.y[local]
            if self.margin is not None:
                out = out.reshape(len(local), -1)
                labels = y.reshape(-1).astype(np.int64)
                true = out[np.arange(len(local)), labels]
                other = out.copy()
                other[np.arange(len(local)), labels] = -np.inf
                best = other.max(axis=1) if out.shape[1] > 1 else np.full(len(local), -np.inf)
                flags[start:start + len(local)] = true - best > self.margin
            else:
                loss = self._per_sample_loss(y, out)
                flags[start:start + len(local)] = loss < self.loss_threshold
        return flags

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Keras takes an epoch's step count from the first epoch of a fit whose data has no
        # known length and cuts longer later epochs short: start each fit with a full pass
        self._full_at = self._epoch
        self.row_weighted = bool(getattr(self.model, "_matex_weighted", False))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._served is None:
            return
        served_epoch, ids = self._served
        flags = self.score(ids)
        everyone = _runtime.control().allgather((ids, np.packbits(flags), len(flags)))
        for rank_ids, packed, n in everyone:
            self.learned[rank_ids] = np.unpackbits(packed, count=n).astype(bool)
        entry = self.history[-1]
        entry["learned_after"] = int(self.learned.sum())
        if logs is not None:
            logs["kept_fraction"] = entry["fraction"]
        if self.verbose:
            _say("sample pruning: epoch %d trained %d of %d samples (%.1f %%%s); %d learned, "
                 "next epoch %s" % (served_epoch + 1, entry["kept"], entry["total"],
                                    100 * entry["fraction"],
                                    ", full pass" if entry["full_pass"] else "",
                                    entry["learned_after"],
                                    "a full pass" if self.is_full_pass(self._epoch) else
                                    "%.1f %%" % (100 * self.kept_fraction(self._epoch))))
