"""``horovod.runner.common``: the helpers Horovod's scripts and tests import."""
