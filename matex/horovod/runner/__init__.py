"""What Horovod scripts and test helpers import from ``horovod.runner`` (launch: matexrun)."""
