"""``horovod.common``: the helpers that scripts import."""
