"""TimelineCallback: hands ``fit``'s step boundaries to the timeline (see ``matex.timeline``)."""

import keras


class TimelineCallback(keras.callbacks.Callback):
    """Marks each training step's start and end in the running timeline, if any.

    ``fit`` adds it on every rank when a timeline is asked for; steps are
    numbered by the optimizer's iteration count (0-based, across epochs and
    ``fit`` calls), the numbers ``--timeline-steps`` selects. Per step it
    costs two clock reads and two reads of the core's sequence number.
    """

    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        self.step = int(optimizer.iterations) if optimizer is not None else 0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        from matex import timeline

        writer = timeline.writer()
        if writer is not None:
            writer.step_begin(self.step)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        from matex import timeline

        writer = timeline.writer()
        if writer is not None:
            writer.step_end(self.step)
        self.step += 1
