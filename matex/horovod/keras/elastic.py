"""``horovod.keras.elastic``: the same as ``matex.horovod.tensorflow.keras.elastic``."""

from matex.horovod.tensorflow.keras.elastic import (CommitStateCallback, KerasState,
                                                    ObjectState, State, TensorFlowKerasState,
                                                    TensorFlowState, UpdateBatchStateCallback,
                                                    UpdateEpochStateCallback, run, run_fn)

__all__ = ["KerasState", "TensorFlowKerasState", "TensorFlowState", "ObjectState", "State",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "run", "run_fn"]
