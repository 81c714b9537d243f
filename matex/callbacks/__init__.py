"""Keras 3 callbacks for data-parallel training (Horovod-style, working on Keras 3).

One callback per module; this package only re-exports them.
"""

from matex.callbacks.broadcast_global_variables import BroadcastGlobalVariablesCallback
from matex.callbacks.learning_rate_warmup import (LearningRateWarmupCallback,
                                                  check_learning_rate_settable)
from matex.callbacks.metric_average import MetricAverageCallback
from matex.callbacks.monitor import MonitorCallback
from matex.callbacks.timeline import TimelineCallback

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateWarmupCallback", "check_learning_rate_settable",
           "MonitorCallback", "TimelineCallback"]
