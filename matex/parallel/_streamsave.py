"""Write a whole model as one plain ``.keras`` file while its weights arrive, one at a time.

``save_model`` and ``PipelineModel.save`` gather a split model's weights on the
writing rank one weight at a time (``_streamgather.stream_gather``). Holding the
whole plain model there to call ``keras.Model.save`` would cost the model's
size (plus its initialisers). Instead the writer builds the plain model
weightless (``_compat.weightless_build``: variables with a shape and dtype, no
value), writes the file's ``metadata.json`` / ``config.json`` and the weights'
HDF5 layout with Keras's own saving walk (``_compat.keras_file_layout``), then
writes each weight into its dataset as it arrives and drops it. The file is
what ``model.save`` writes (same members, same HDF5 groups and attributes), so
plain ``keras.models.load_model`` reads it.
"""

import os
import tempfile
import zipfile

import logging

import numpy as np

from matex import _compat

_log = logging.getLogger("matex")


def streamable(filepath, **kwargs) -> bool:
    """Whether a save to ``filepath`` can be streamed: a local ``.keras`` path, no options.

    Anything else (a file object, a remote URL, ``zipped=False``) is saved the
    way Keras saves it, from a whole model.
    """
    if kwargs or not isinstance(filepath, (str, os.PathLike)):
        return False
    filepath = os.fspath(filepath)
    return isinstance(filepath, str) and filepath.endswith(".keras") and "://" not in filepath


class StreamedKerasFile:
    """The ``.keras`` file of ``model`` (built weightless), its weights written one by one.

    Opening it writes everything but the weight values; ``write(variable,
    value)`` fills one variable's dataset; ``finish()`` writes what was not
    streamed (a variable no rank offers keeps its initial value, as a freshly
    built model would save it) and moves it onto ``filepath``; ``abort()`` removes
    what was written. The file is written beside the target and renamed over it
    only when complete, so a failed save leaves an existing file as it was.
    """

    def __init__(self, model, filepath, overwrite: bool = True):
        filepath = os.fspath(filepath)
        self.filepath = filepath
        self._file = self._zip = self._h5 = None
        self._tmp = self._partial = None
        self.cancelled = os.path.exists(filepath) and not overwrite \
            and not _compat.ask_to_overwrite(filepath)
        if self.cancelled:
            return
        try:
            directory = os.path.dirname(os.path.abspath(filepath))
            fd, self._partial = tempfile.mkstemp(
                prefix="." + os.path.basename(filepath) + ".", suffix=".partial", dir=directory)
            self._file = os.fdopen(fd, "wb")
            self._zip = zipfile.ZipFile(self._file, "w")
            # the weights' HDF5 file, next to the target (Keras does the same for big models)
            fd, self._tmp = tempfile.mkstemp(suffix=".weights.h5", dir=directory)
            os.close(fd)
            self._h5, pairs, self._member = _compat.keras_file_layout(model, self._zip, self._tmp)
        except BaseException:
            self.abort()
            raise
        # id -> [variable, dataset, elements written]
        self._pending = {id(variable): [variable, dataset, 0] for variable, dataset in pairs}

    def write(self, variable, axis, offset: int, value) -> None:
        """Write ``value`` (an array) into ``variable``'s weights: all of them (axis
        None), or the block starting at ``offset`` along ``axis``."""
        if self.cancelled:
            return
        entry = self._pending.get(id(variable))
        if entry is None:
            raise ValueError("matex.parallel: %s is not saved in the file (or written twice)"
                             % variable.path)
        dataset = entry[1]
        shape = tuple(dataset.shape)
        index = [slice(None)] * len(shape)
        if axis is not None:
            axis = axis % len(shape)
            index[axis] = slice(offset, offset + np.shape(value)[axis])
        block = tuple(len(range(*i.indices(n))) for i, n in zip(index, shape))
        if block != tuple(np.shape(value)):
            raise ValueError("matex.parallel: %s has shape %s in the file; a block %s at "
                             "offset %d along axis %s does not fit"
                             % (variable.path, shape, np.shape(value), offset, axis))
        dataset[tuple(index)] = value
        entry[2] += int(np.size(value))
        if entry[2] >= dataset.size:
            del self._pending[id(variable)]

    def finish(self) -> None:
        """Write the variables no rank sent (their initial values) and close the file."""
        if self.cancelled:
            return
        try:
            for variable, dataset, written in self._pending.values():
                if written:
                    raise ValueError("matex.parallel: only %d of the %d values of %s arrived"
                                     % (written, dataset.size, variable.path))
                dataset[...] = np.asarray(variable.value)   # a draw of its initializer
            self._pending = {}
            self._h5.close()
            self._h5 = None
            self._zip.write(self._tmp, self._member)
            self._zip.close()
            self._zip = None
            self._file.close()
            self._file = None
            os.chmod(self._partial, 0o666 & ~_umask())
            os.replace(self._partial, self.filepath)
            self._partial = None
        except BaseException:
            self.abort()
            raise
        os.remove(self._tmp)
        self._tmp = None

    def abort(self) -> None:
        """Close and remove what was written (the target file and the temporary one)."""
        for closing in (self._h5, self._zip, self._file):
            try:
                if closing is not None:
                    closing.close()
            except Exception:  # noqa: BLE001 - cleaning up after the error being raised
                pass
        self._h5 = self._zip = None
        self._file = None
        if self._partial is not None:
            _remove(self._partial)
            self._partial = None
        if self._tmp is not None:
            _remove(self._tmp)
            self._tmp = None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


def save_streamed(comm, root: int, build, offers, variable_of, filepath, overwrite: bool,
                  what: str, compiled_like=None) -> None:
    """Collective over ``comm``: ``root`` writes ``filepath`` as the weights stream in.

    ``build()`` (root only, weightless) makes the plain model; ``offers`` are this
    rank's pieces (``weight_offers`` of ``_tensor``); ``variable_of(model, key)`` is the
    plain model's variable a streamed key fills. A failure to build is a
    ValueError on every rank, a failure to open or write the file a
    ``RemoteError`` (``MatexError``, naming root) on every rank, before or after
    the transfers: no rank is left waiting. ``compiled_like``: a compiled model
    whose compile config the file records, as ``model.save`` of a compiled model
    does (the optimizer is created, not built: no optimizer state, as for a model
    compiled and never trained).
    """
    from matex._everywhere import RemoteError, on_every_rank
    from matex.parallel._streamgather import stream_gather

    me = comm.Get_rank()
    saving = "matex.parallel: saving %s" % (filepath,)

    def skeleton():
        if me != root:
            return None
        try:
            with _compat.weightless_build():
                whole = build()
        except ValueError as exc:
            # a layer that makes a variable from a value, not an initializer: build it
            # whole (the previous cost: the whole model on root), still streamed to the file
            _log.warning("matex.parallel: the model cannot be built without its weights "
                         "(%s); rank 0 builds it whole to save it", str(exc).split("\n")[0])
            whole = build()
        if compiled_like is not None and compiled_like.compiled:
            # outside the weightless scope: the optimizer's own variables are small
            import keras
            whole.compile(**keras.saving.deserialize_keras_object(
                compiled_like.get_compile_config()))
        return whole

    whole = on_every_rank(comm, skeleton, error_type=ValueError, what=what)
    writer = on_every_rank(comm, lambda: StreamedKerasFile(whole, filepath, overwrite)
                           if me == root else None, error_type=RemoteError, what=saving)
    try:
        stream_gather(
            comm, root, offers, None, what,
            part_sink=lambda key, axis, offset, value: writer.write(
                variable_of(whole, key), axis, offset, value))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    on_every_rank(comm, lambda: writer.finish() if writer is not None else None,
                  error_type=RemoteError, what=saving)
