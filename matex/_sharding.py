"""Old name of ``matex._batch_slicing``, kept only until every import uses the new one.

Temporary re-export (to be deleted once matex/_keras and matex/__init__ import
``matex._batch_slicing``).
"""

from matex._batch_slicing import (SHARDED_ATTR, SHARDED_TAG, ArrayShards,  # noqa: F401
                                  is_array_input, is_sharded, mark_sharded, shard,
                                  shard_generator, shard_pydataset, slice_bounds)
