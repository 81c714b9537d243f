// Sparse allreduce of the MaTEx core (SparCML, arXiv 1802.08021): the sum over
// ranks of rows given as (row index, row values) pairs. No MPI or TensorFlow
// headers: the kernels include this next to matex_core.h.
#ifndef MATEX_CORE_SPARSE_H_
#define MATEX_CORE_SPARSE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "matex_core.h"

namespace matex {

// Where the result goes: `allocate(rows, dense)` is called once, after the
// exchange, with the number of result rows; it returns the index buffer
// (`rows` int64s, filled by the core with sorted unique row ids, or 0..rows-1
// when `dense`) and the values buffer (`rows` rows), or nulls on failure.
struct SparseBuffers {
  int64_t* indices = nullptr;
  void* values = nullptr;
};
using SparseAllocate = std::function<SparseBuffers(int64_t rows, bool dense)>;

// Sum over the ranks of slot `slot` of a [dense_rows, row...] tensor given on
// each rank as `nnz` (index, row) pairs: `indices` in [0, dense_rows), in any
// order, duplicates allowed (summed); `values` holds nnz rows of `row_elems`
// elements of `dtype`. Recursive doubling of sorted (index, row) streams,
// merged (duplicates summed) at every step; a stream of `switch_rows` rows or
// more travels dense from then on (rows absent are zeros). Ranks beyond the
// largest power of two fold their stream into a partner first and get the
// result from it last. The merge adds two operands in the same way on both
// partners, so every rank gets a bitwise identical result.
//
// `dense_rows`, the row shape (`row_shape`), `dtype` and `switch_rows` must
// agree across ranks (checked); `nnz` need not. An index out of range on any
// rank fails the call on every rank. `bytes_sent` receives the bytes this
// rank handed to MPI (headers included; not the agreement check).
Status SparseAllreduce(const int64_t* indices, int64_t nnz, const void* values,
                       const std::vector<int64_t>& row_shape, int64_t dense_rows,
                       DataType dtype, int64_t switch_rows, const SparseAllocate& allocate,
                       int64_t* bytes_sent, int slot = 0);

}  // namespace matex

#endif  // MATEX_CORE_SPARSE_H_
