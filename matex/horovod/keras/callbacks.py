"""``horovod.keras.callbacks``: Horovod's Keras callbacks on Keras 3."""

from matex.horovod._callbacks import (BroadcastGlobalVariablesCallback,
                                      LearningRateScheduleCallback, LearningRateWarmupCallback,
                                      MetricAverageCallback)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]
