// Non-blocking allreduce of the MaTEx core: post now, collect later.
//
// `IallreduceStart` checks agreement (overlapped with packing, as the fused
// allreduce does), packs the tensors into a buffer the core owns and posts
// MPI_Iallreduce on it; it returns a handle. Compute goes on meanwhile: a
// core thread enters MPI every millisecond while a request is pending (Open
// MPI progresses a non-blocking collective only inside MPI calls), so the
// transfer advances without the caller. `IallreduceWait` completes it and
// copies the result out. No MPI or TensorFlow headers: the kernels include
// this next to matex_core.h.
//
// Ordering: the post is a collective call and is serialised with the blocking
// collectives of its communicator (CollectiveMutex); other collectives may run
// on the same communicator while it is outstanding (legal in MPI as long as
// every rank issues its collectives in the same order, which program order in
// a traced step guarantees). The wait issues nothing, so its place does not
// matter for matching.
#ifndef MATEX_CORE_NONBLOCKING_H_
#define MATEX_CORE_NONBLOCKING_H_

#include <cstdint>
#include <vector>

#include "matex_core.h"

namespace matex {

// Post an allreduce of `ins` (one dtype; op sum or average) on slot `slot`.
// On success `*handle` (> 0) names the pending request. The inputs are
// copied: they may be freed at once.
Status IallreduceStart(const std::vector<TensorRef>& ins, DataType dtype, ReduceOp op,
                       int slot, int64_t* handle);

// Complete `handle` and copy each tensor's result into `outs[i]`, which must
// hold the element count the tensor had at start (`shapes`, when non-null,
// receives those shapes first: checked by the caller). The handle is released
// whatever the outcome; an unknown handle is an Invalid status.
Status IallreduceWait(int64_t handle, const std::vector<void*>& outs,
                      std::vector<std::vector<int64_t>>* shapes_at_start = nullptr);

// Shapes and dtype the tensors of `handle` had at start (no MPI).
Status IallreduceShapes(int64_t handle, DataType* dtype,
                        std::vector<std::vector<int64_t>>* shapes);

// Forget every pending request (after a rank failure: their communicator is
// revoked, so each completes, with an error, at once). Returns how many.
int64_t IallreduceDropAll();

// Forget every pending request without completing it, and stop entering MPI
// for them: at process exit, before MPI_Finalize (peers may be gone).
int64_t IallreduceForgetAll();

// Requests posted and not yet waited for or dropped.
int64_t IallreducePending();

}  // namespace matex

#endif  // MATEX_CORE_NONBLOCKING_H_
