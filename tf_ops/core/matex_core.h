// MaTEx core: the MPI collectives behind the TensorFlow ops and the pybind11 module.
//
// This header deliberately includes neither mpi.h nor TensorFlow headers: the
// communicator crosses this boundary as an integer handle (what mpi4py's
// MPI._handleof returns), so the TF kernels compile without MPI headers and the
// core compiles without TensorFlow.
//
// The core is thin: it moves bytes and reports MPI failures. Policy (which
// tensors to fuse, when to replace the communicator, how to recover) lives in
// Python.
#ifndef MATEX_CORE_H_
#define MATEX_CORE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace matex {

enum class DataType : int {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kInt64 = 5,
};

enum class ReduceOp : int { kSum = 0, kAverage = 1, kMin = 2, kMax = 3 };

// Outcome of a core call. `mpi_error_class` is the MPI error class (as from
// MPI_Error_class) when an MPI call failed, 0 when the failure is not an MPI
// error (e.g. tensors that disagree across ranks), and `ok()` on success.
struct Status {
  enum class Kind : int { kOk = 0, kMpiError = 1, kMismatch = 2, kInvalid = 3 };
  Kind kind = Kind::kOk;
  int mpi_error_class = 0;
  std::string message;

  bool ok() const { return kind == Kind::kOk; }
  static Status Ok() { return Status(); }
  static Status Mpi(int error_class, std::string msg) {
    return Status{Kind::kMpiError, error_class, std::move(msg)};
  }
  static Status Mismatch(std::string msg) {
    return Status{Kind::kMismatch, 0, std::move(msg)};
  }
  static Status Invalid(std::string msg) {
    return Status{Kind::kInvalid, 0, std::move(msg)};
  }
};

size_t DataTypeSize(DataType dtype);
const char* DataTypeName(DataType dtype);
const char* ReduceOpName(ReduceOp op);

// The communicator every collective uses. Replaceable at any time (the
// resilience layer swaps in a shrunk communicator); each collective reads it
// once at its start. 0 means "not set".
void SetCommunicator(std::intptr_t handle);
std::intptr_t GetCommunicator();

// Whether to run the cross-rank agreement check (shape/dtype/op) before each
// collective. On by default; turning it off saves one tiny allreduce per
// collective but turns a mismatch into undefined behaviour (a hang, at best).
void SetAgreementCheck(bool enabled);
bool AgreementCheck();

// Rank and size in the current communicator.
Status CommInfo(int* rank, int* size);

// A tensor as the core sees it: contiguous bytes with a shape.
struct TensorRef {
  const void* data;
  std::vector<int64_t> shape;
  int64_t num_elements() const;
};

// out[i] = reduce over ranks of in[i]; `in` and `out` may be the same buffer
// (in place); otherwise MPI reads `in` and writes `out` directly (no copy).
// kAverage divides the sum by the communicator size at the time of the call.
Status Allreduce(const TensorRef& in, void* out, DataType dtype, ReduceOp op);

// Fused allreduce of several tensors of one dtype: one MPI call on a packed
// buffer. `scratch` must hold the sum of all element counts (may be null when
// there is a single tensor, which is then reduced in place of `outs[0]`).
Status FusedAllreduce(const std::vector<TensorRef>& ins,
                      const std::vector<void*>& outs, DataType dtype,
                      ReduceOp op, void* scratch);

// Broadcast from `root` of the current communicator. On the root `data` is
// read; elsewhere it is written. All ranks must pass the same shape.
Status Broadcast(void* data, const std::vector<int64_t>& shape, DataType dtype,
                 int root);

// Concatenation along axis 0 of every rank's tensor; first dimensions may
// differ, the others must agree. `allocate(total_rows)` is called once, after
// the sizes are known, and returns the output buffer (or null on failure, with
// the reason left to the caller). `first_dims` receives one entry per rank.
Status Allgather(const TensorRef& in, DataType dtype,
                 const std::function<void*(int64_t total_rows)>& allocate,
                 std::vector<int64_t>* first_dims);

// Number of MPI collective calls the core issued (data and agreement calls
// alike) since the library was loaded. For tests and benchmarks.
int64_t CollectiveCallCount();

// Enter MPI from a background thread every `interval_seconds`, so that MPI's
// progress engine (ULFM's heartbeat failure detector) runs while every other
// thread computes. Idempotent; Stop joins the thread (call before
// MPI_Finalize).
void StartProgressThread(double interval_seconds);
void StopProgressThread();
bool ProgressThreadRunning();

}  // namespace matex

#endif  // MATEX_CORE_H_
