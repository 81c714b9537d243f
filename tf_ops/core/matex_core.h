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
  kUInt8 = 6,
  kInt8 = 7,
  kUInt16 = 8,
  kInt16 = 9,
  kBool = 10,   // one byte, 0 or 1; reduced as uint8 (min: and, max: or, product: and)
};

enum class ReduceOp : int { kSum = 0, kAverage = 1, kMin = 2, kMax = 3, kProduct = 4 };

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

// The communicators operations use, in numbered slots. Slot 0 is the data
// communicator every collective uses by default; other slots hold
// sub-communicators (a pipeline or tensor-parallel group of a grid), chosen
// per operation by its `slot` argument (the ops' `comm` attribute). A slot is
// replaceable at any time (the resilience layer swaps in a shrunk
// communicator); each operation reads it once at its start, so nothing holds
// a stale communicator. 0 means "not set".
constexpr int kMaxCommSlots = 64;
void SetCommunicator(std::intptr_t handle);   // slot 0
std::intptr_t GetCommunicator();
void SetCommunicatorSlot(int slot, std::intptr_t handle);
std::intptr_t GetCommunicatorSlot(int slot);

// Whether to run the cross-rank agreement check (shape/dtype/op) before each
// collective. On by default; turning it off saves one tiny allreduce per
// collective but turns a mismatch into undefined behaviour (a hang, at best).
void SetAgreementCheck(bool enabled);
bool AgreementCheck();

// Rank and size in the current communicator.
Status CommInfo(int* rank, int* size, int slot = 0);

// A tensor as the core sees it: contiguous bytes with a shape.
struct TensorRef {
  const void* data;
  std::vector<int64_t> shape;
  int64_t num_elements() const;
};

// out[i] = reduce over ranks of in[i]; `in` and `out` may be the same buffer
// (in place); otherwise MPI reads `in` and writes `out` directly (no copy).
// kAverage divides the sum by the communicator size at the time of the call.
Status Allreduce(const TensorRef& in, void* out, DataType dtype, ReduceOp op,
                 int slot = 0);

// Fused allreduce of several tensors of one dtype: one MPI call on a packed
// buffer. `scratch` must hold the sum of all element counts (may be null when
// there is a single tensor, which is then reduced in place of `outs[0]`).
Status FusedAllreduce(const std::vector<TensorRef>& ins,
                      const std::vector<void*>& outs, DataType dtype,
                      ReduceOp op, void* scratch, int slot = 0);

// Broadcast from `root` of the current communicator. On the root `data` is
// read; elsewhere it is written. All ranks must pass the same shape.
Status Broadcast(void* data, const std::vector<int64_t>& shape, DataType dtype,
                 int root, int slot = 0);

// Concatenation along axis 0 of every rank's tensor; first dimensions may
// differ, the others must agree. `allocate(total_rows)` is called once, after
// the sizes are known, and returns the output buffer (or null on failure, with
// the reason left to the caller). `first_dims` receives one entry per rank.
Status Allgather(const TensorRef& in, DataType dtype,
                 const std::function<void*(int64_t total_rows)>& allocate,
                 std::vector<int64_t>* first_dims, int slot = 0);

// Rank i sends rows [off_j, off_j + splits[j]) of `in` (axis 0) to rank j, and
// receives the concatenation, in rank order, of the rows every rank sends it.
// `splits` empty: an equal split (the first dimension must divide by the
// number of ranks). A rank's invalid splits (wrong count, negative, not
// summing to its first dimension) fail the call on every rank, with the same
// message. `allocate(total_rows)` returns the output buffer; `recv_splits`
// receives the rows got from each rank.
Status Alltoall(const TensorRef& in, const std::vector<int64_t>& splits, DataType dtype,
                const std::function<void*(int64_t total_rows)>& allocate,
                std::vector<int64_t>* recv_splits, int slot = 0);

// Reduce `in` (same shape on every rank) over the ranks, then scatter axis 0:
// rank r gets rows [RowOffset(r), RowOffset(r) + rows(r)), where the first
// `n % size` ranks get `n / size + 1` rows and the others `n / size`.
// `allocate(rows)` returns the output buffer for this rank's rows.
Status Reducescatter(const TensorRef& in, DataType dtype, ReduceOp op,
                     const std::function<void*(int64_t rows)>& allocate, int slot = 0);

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

// ---- flight recorder -------------------------------------------------------
//
// The last N collectives of this process, kept in a ring buffer: what each one
// was (kind, dtype, shapes, communicator), when it started, when every rank had
// arrived (the agreement check completed) and when it ended, and how. Python
// dumps it (SIGUSR1, a rank failure, a stall) and `python -m matex.flight`
// compares the dumps of all ranks. Recording is a few stores per collective;
// with capacity 0 nothing is recorded but the sequence number and the pending
// collective's start (what the stall inspector watches).

enum class FlightState : int { kPending = 0, kOk = 1, kMismatch = 2, kMpiError = 3, kInvalid = 4 };

struct FlightEntry {
  int64_t seq = 0;            // 1, 2, ...: every collective of this process, in order
  uint64_t comm_id = 0;       // the communicator (FlightComm::id; 0: unknown)
  int64_t comm_seq = 0;       // 1, 2, ...: the collectives on that communicator, in order
                              // (what compares across its members; 0: point-to-point)
  int kind = 0;               // internal::Kind: 1 allreduce ... 4 allgather, 5.. p2p/sparse
  int dtype = 0;              // DataType
  int64_t param = 0;          // ReduceOp, or the broadcast root
  int comm_rank = 0;
  int comm_size = 0;
  int num_tensors = 0;
  int64_t bytes = 0;          // this rank's input bytes (sparse allreduce: bytes sent)
  int ndims = 0;              // first tensor's shape (up to 8 dims)
  int64_t dims[8] = {0};
  uint64_t signature = 0;     // the agreement check's hash: equal across agreeing ranks
  double start = 0, agreed = 0, end = 0;   // seconds since the epoch; 0: not reached
  int state = 0;              // FlightState
  int mpi_error_class = 0;
  char site[96] = {0};        // TF node name, or Python file:line (see SetFlightSite)
};

// A communicator the collectives used: its id, equal on all its members (a
// hash of the members' world ranks and of how many communicators with the
// same members this process installed before it, so assigned without
// communication when it is put in a slot), its members' ranks in
// MPI_COMM_WORLD, the number of collectives started on it, and the one
// waiting now (its number and start; 0 when none). Each communicator has its
// own order of collectives: only numbers on the same communicator compare
// across ranks.
struct FlightComm {
  uint64_t id = 0;
  std::vector<int> members;
  int64_t seq = 0;
  int64_t pending_seq = 0;
  double pending_since = 0;
  bool current = false;       // still in a slot (else one it replaced, kept for dumps)
  std::vector<int> slots;     // the slots it is in now
};
// The communicators in the slots, then the last few they replaced.
std::vector<FlightComm> FlightComms();

// Keep the last `capacity` collectives (0: record none). Clears the buffer.
void SetFlightCapacity(int capacity);
int FlightCapacity();
// The recorded collectives, oldest first (a consistent copy).
std::vector<FlightEntry> FlightEntries();
// Sequence number of the last collective started, and, when one is in
// progress, its start time (else 0). Lock-free: safe from any thread.
int64_t FlightSequence();
double FlightPendingSince();
// Where the next collective on this thread comes from; the pointer must stay
// valid until that collective returns (nullptr: unknown).
void SetFlightSite(const char* site);
// Make signal `signum` (SIGUSR1) set a flag that TakeFlightSignal returns and
// clears: a dumping thread polls it, so a dump happens while the main thread
// is blocked in MPI or compute. False when the signal already has a handler.
bool InstallFlightSignal(int signum);
bool TakeFlightSignal();

// ---- graph-mode turnstile (turnstile.cc) ----
// The collectives (node names) one TF1 Session.run will execute, in the order
// every rank runs them; until EndGraphRun, TakeTurn queues them in that order.
void BeginGraphRun(std::vector<std::string> order);
// The run returned: ungated again. Returns how many collectives took their turn.
int EndGraphRun();
enum class Turn {
  kNow,          // no scheduled run in progress: call `run` yourself, now
  kQueued,       // `run` will be called on the turnstile's thread in its turn
  kUnscheduled,  // a scheduled run is in progress and `name` is not (or no more) in it
};
Turn TakeTurn(const std::string& name, std::function<void()> run);
// Take a queued collective out (its run was cancelled); false if it already ran.
bool Withdraw(const std::string& name);

}  // namespace matex

#endif  // MATEX_CORE_H_
