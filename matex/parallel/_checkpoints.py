"""``PipelineModel`` checkpoints: resume a pipelined run on a grid with another data size.

Each (stage, tensor shard) of data replica 0 writes its stage's and optimizer's
variables to ``stage<p>_tensor<t>.g<N>.npz``; world rank 0 writes ``meta.json``
(naming generation N) last, so an interrupted save leaves the previous
checkpoint whole. Every step that a peer waits for agrees on errors
(``matex._everywhere``): a bad directory or a corrupt file is a ValueError on
every rank.
"""

import numpy as np

from matex.parallel._execution import _agreed


def _checkpoint_generation(directory):
    """The generation ``directory/meta.json`` names: None for none (no checkpoint, an
    unreadable one, or one written before generations)."""
    import json
    import os

    try:
        with open(os.path.join(directory, "meta.json")) as f:
            generation = json.load(f).get("generation")
    except (OSError, ValueError, AttributeError):
        return None
    return generation if isinstance(generation, int) else None


class PipelineCheckpoints:
    """``save_checkpoint`` / ``restore_checkpoint`` of a ``PipelineModel`` (a mixin)."""

    def _checkpoint_file(self, directory, generation=None):
        """This rank's stage file of checkpoint ``generation`` (None: the unnumbered name
        of checkpoints written before generations)."""
        import os

        L = self._layout
        suffix = "" if generation is None else ".g%d" % generation
        return os.path.join(directory, "stage%d_tensor%d%s.npz" % (L.pipeline_rank,
                                                                   L.tensor_rank, suffix))

    def _optimizer_variables(self):
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None:
            raise ValueError("matex.parallel: compile the PipelineModel before saving or "
                             "restoring a checkpoint")
        if not optimizer.built:
            optimizer.build(self.stage.trainable_variables)
        return list(optimizer.variables)

    def save_checkpoint(self, directory: str) -> None:
        """Write this run's state so that a grid with another data dimension can resume it.

        Collective. Each (stage, tensor shard) of data replica 0 writes its
        stage's variables and its optimizer's variables (Adam's moments, the
        step count) to ``directory/stage<p>_tensor<t>.g<N>.npz``, N one more than
        the generation ``meta.json`` names; world rank 0 writes ``meta.json`` (P, T,
        D, the stages, N) last, once every stage file is in place, each file
        through a temporary and a rename; only then go generation N-1's files. A
        save interrupted anywhere leaves the previous checkpoint whole: the
        ``meta.json`` in place names only stage files of one generation. The replicas are
        equal, so one copy serves any number of them:
        ``restore_checkpoint`` on a grid with the same pipeline and tensor
        sizes and any data size continues the run as if it had not stopped.
        """
        import json
        import os

        self._require_built()
        L = self._layout

        def written(store):
            def write():
                try:
                    store()
                except OSError as exc:
                    raise ValueError("matex.parallel: cannot write a checkpoint to %s: %s"
                                     % (directory, exc)) from None
            return write

        def replace(target, dump, mode):
            # through a temporary file: a writer killed midway leaves the old file whole
            with open(target + ".tmp", mode) as f:
                dump(f)
            os.replace(target + ".tmp", target)

        previous = None
        if L.world_rank == 0:
            previous = _checkpoint_generation(directory)
        previous = L.control.bcast(previous, root=0)
        generation = (previous or 0) + 1

        def store_stage():
            variables = self._optimizer_variables()
            os.makedirs(directory, exist_ok=True)
            if L.data_rank == 0:
                arrays = {"w%d" % i: np.asarray(v) for i, v in enumerate(self.stage.variables)}
                arrays.update({"o%d" % i: np.asarray(v) for i, v in enumerate(variables)})
                replace(self._checkpoint_file(directory, generation),
                        lambda f: np.savez(f, **arrays), "wb")

        def store_meta():
            if L.world_rank == 0:
                meta = {"pipeline": L.pipeline_size, "tensor": L.tensor_size,
                        "data": L.data_size, "stages": self.plan.stage_layers,
                        "generation": generation}
                replace(os.path.join(directory, "meta.json"), lambda f: json.dump(meta, f), "w")

        _agreed(L.control, written(store_stage))
        # last, once every stage's file is in place: a meta.json never names missing stages
        _agreed(L.control, written(store_meta))
        if L.data_rank == 0:
            # the previous generation is no longer named; a file left behind is harmless
            try:
                os.remove(self._checkpoint_file(directory, previous))
            except OSError:
                pass

    def restore_checkpoint(self, directory: str) -> None:
        """Load what ``save_checkpoint`` wrote: stage and optimizer variables (collective).

        The grid may have another data size than the run that wrote it; its
        pipeline and tensor sizes and its stages must be the same (a
        ``ValueError`` on every rank otherwise, as for a missing file or a
        variable of another shape). Compile first.
        """
        import json
        import os

        self._require_built()
        L = self._layout

        def read():
            try:
                load()
            except (OSError, KeyError) as exc:
                raise ValueError("matex.parallel: cannot read the checkpoint in %s: %s: %s"
                                 % (directory, type(exc).__name__, exc)) from None

        def load():
            path = os.path.join(directory, "meta.json")
            if not os.path.exists(path):
                raise ValueError("matex.parallel: no checkpoint in %s (no meta.json)"
                                 % directory)
            with open(path) as f:
                meta = json.load(f)
            if (meta["pipeline"], meta["tensor"]) != (L.pipeline_size, L.tensor_size) or \
                    meta["stages"] != self.plan.stage_layers:
                raise ValueError(
                    "matex.parallel: the checkpoint in %s is of a %d-stage x %d-way tensor "
                    "pipeline with stages %s; this one is %d x %d with stages %s: the pipeline "
                    "and tensor sizes and the stages must match (the data size may differ)"
                    % (directory, meta["pipeline"], meta["tensor"], meta["stages"],
                       L.pipeline_size, L.tensor_size, self.plan.stage_layers))
            variables = self._optimizer_variables()
            with np.load(self._checkpoint_file(directory, meta.get("generation"))) as data:
                pairs = [(v, data["w%d" % i]) for i, v in enumerate(self.stage.variables)]
                pairs += [(v, data["o%d" % i]) for i, v in enumerate(variables)]
                if len(data.files) != len(pairs):
                    raise ValueError("matex.parallel: the checkpoint holds %d variables for "
                                     "this rank, the model and optimizer have %d"
                                     % (len(data.files), len(pairs)))
            for v, value in pairs:
                if tuple(v.shape) != value.shape:
                    raise ValueError("matex.parallel: checkpoint variable of shape %s for %s "
                                     "of shape %s" % (value.shape, v.path, tuple(v.shape)))
            for v, value in pairs:
                v.assign(value)

        _agreed(L.control, read)
        self._synced = True   # every replica read the same values
