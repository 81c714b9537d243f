"""``horovod.runner.util``: the helpers that scripts import."""
