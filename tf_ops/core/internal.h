// Internals of the MaTEx core shared by its translation units (collectives,
// point-to-point, sparse and non-blocking operations): communicator slots,
// MPI error reporting, the cross-rank agreement check and the flight
// recorder. Includes mpi.h, so only core sources include it; the TF kernels
// and the pybind11 module see matex_core.h alone.
#ifndef MATEX_CORE_INTERNAL_H_
#define MATEX_CORE_INTERNAL_H_

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "matex_core.h"

namespace matex {
namespace internal {

// What an agreement check and a flight entry describe. The numbers are the
// flight recorder's `kind` (matex/flight/_analysis.py names them).
enum class Kind : int64_t {
  kAllreduce = 1, kFused = 2, kBroadcast = 3, kAllgather = 4,
  kSend = 5, kRecv = 6, kSendRecv = 7, kSparseAllreduce = 8, kIallreduce = 9,
  kAlltoall = 10, kReducescatter = 11,
};

using Shapes = std::vector<const std::vector<int64_t>*>;

// The MPI communicator in slot `slot`, read once under the slot table's lock.
Status CurrentComm(MPI_Comm* comm, int slot = 0);
// Operations on one communicator run one at a time in this process (ranks
// must issue them in the same order); different communicators do not wait
// for each other.
std::mutex& CollectiveMutex(int slot);

Status MpiFailure(int rc, const char* what);
void CountCall();   // one more MPI collective (CollectiveCallCount)

#define MATEX_MPI(call, what)                                       \
  do {                                                              \
    int rc_ = (call);                                               \
    if (rc_ != MPI_SUCCESS) return ::matex::internal::MpiFailure(rc_, what); \
  } while (0)

// A collective call: counted, for tests and benchmarks.
#define MATEX_COLL(call, what)          \
  do {                                  \
    ::matex::internal::CountCall();     \
    MATEX_MPI(call, what);              \
  } while (0)

MPI_Datatype MpiType(DataType dtype);
MPI_Op MpiOp(DataType dtype, ReduceOp op);
// Divide a summed buffer by `size` (integers truncate, as C does).
void Average(void* data, int64_t n, DataType dtype, int size);
// Allreduce of `count` elements from `in` into `data` (in place when they are
// the same buffer), in chunks that fit MPI's int count; kAverage divides.
Status AllreduceInto(MPI_Comm comm, const void* in, void* data, int64_t count,
                     DataType dtype, ReduceOp op);

uint64_t SignatureHash(Kind kind, DataType dtype, int64_t param, const Shapes& shapes);
std::string SignatureText(Kind kind, DataType dtype, int64_t param, const Shapes& shapes);

// One communicator's flight state: its id (equal on all its members without
// communication: a hash of its members' world ranks and of how many
// communicators with those members this process had installed before) and
// its own count of collectives, since each communicator has its own order.
struct CommFlight {
  uint64_t id = 0;
  std::vector<int> members;                  // world ranks, in communicator rank order
  std::atomic<int64_t> seq{0};               // collectives started on it
  std::atomic<int64_t> pending_seq{0};       // the collective waiting now (0: none)
  std::atomic<double> pending_since{0.0};    // since when it waits (0: none)
  bool current = true;                       // still in a slot (guarded by the slot table's lock)
};

// The flight state of `comm`, one of the communicators in the slots (null when
// it is in none: replaced meanwhile).
std::shared_ptr<CommFlight> CommFlightOf(MPI_Comm comm);

extern std::atomic<bool> g_check;
extern std::mutex g_flight_mutex;
extern std::vector<FlightEntry> g_ring;
extern std::atomic<int> g_flight_capacity;
extern std::atomic<int64_t> g_seq;
extern std::atomic<double> g_pending_since;
extern thread_local const char* t_site;
double Now();

// One collective's entry: opened at its start, stamped when all ranks agreed,
// closed with its outcome. Holds the ring's lock only to copy in or update.
// `ordered`: a collective, counted in its communicator's order (comm_seq);
// point-to-point transfers are not (only the two peers take part), their
// comm_seq is 0.
class FlightRecord {
 public:
  FlightRecord(MPI_Comm comm, Kind kind, DataType dtype, int64_t param, const Shapes& shapes,
               uint64_t signature, bool ordered = true) {
    seq_ = g_seq.fetch_add(1, std::memory_order_relaxed) + 1;
    const double now = Now();
    g_pending_since.store(now, std::memory_order_relaxed);
    comm_ = CommFlightOf(comm);
    if (comm_ && ordered) {
      comm_seq_ = comm_->seq.fetch_add(1, std::memory_order_relaxed) + 1;
      comm_->pending_seq.store(comm_seq_, std::memory_order_relaxed);
      comm_->pending_since.store(now, std::memory_order_relaxed);
    }
    if (g_flight_capacity.load(std::memory_order_relaxed) == 0) return;
    FlightEntry e;
    e.seq = seq_;
    e.comm_id = comm_ ? comm_->id : 0;
    e.comm_seq = comm_seq_;
    e.kind = int(kind);
    e.dtype = int(dtype);
    e.param = param;
    MPI_Comm_rank(comm, &e.comm_rank);
    MPI_Comm_size(comm, &e.comm_size);
    e.num_tensors = int(shapes.size());
    int64_t elements = 0;
    for (const auto* shape : shapes) {
      int64_t n = 1;
      for (int64_t d : *shape) n *= d;
      elements += n;
    }
    e.bytes = elements * int64_t(DataTypeSize(dtype));
    if (!shapes.empty()) {
      e.ndims = int(std::min<size_t>(shapes[0]->size(), 8));
      for (int i = 0; i < e.ndims; ++i) e.dims[i] = (*shapes[0])[i];
    }
    e.signature = signature;
    e.start = now;
    if (t_site) std::strncpy(e.site, t_site, sizeof(e.site) - 1);
    std::lock_guard<std::mutex> lock(g_flight_mutex);
    if (g_ring.empty()) return;   // switched off meanwhile
    g_ring[size_t((seq_ - 1) % int64_t(g_ring.size()))] = e;
    recording_ = true;
  }

  void Agreed() {
    if (recording_) Update([](FlightEntry& e) { e.agreed = Now(); });
  }

  // The bytes this rank actually sent, where they differ from its input's
  // (the sparse allreduce: its stream, not the dense tensor).
  void SetBytes(int64_t bytes) {
    if (recording_) Update([bytes](FlightEntry& e) { e.bytes = bytes; });
  }

  Status Done(Status s) {
    g_pending_since.store(0.0, std::memory_order_relaxed);
    if (comm_seq_ > 0) {
      int64_t expected = comm_seq_;   // a later collective's wait stays visible
      if (comm_->pending_seq.compare_exchange_strong(expected, 0)) {
        comm_->pending_since.store(0.0, std::memory_order_relaxed);
      }
    }
    if (!recording_) return s;
    int state = int(FlightState::kOk);
    if (s.kind == Status::Kind::kMismatch) state = int(FlightState::kMismatch);
    if (s.kind == Status::Kind::kMpiError) state = int(FlightState::kMpiError);
    if (s.kind == Status::Kind::kInvalid) state = int(FlightState::kInvalid);
    const int cls = s.mpi_error_class;
    Update([&](FlightEntry& e) {
      e.end = Now();
      if (e.agreed == 0 && state == int(FlightState::kOk)) e.agreed = e.end;
      e.state = state;
      e.mpi_error_class = cls;
    });
    return s;
  }

  // The communicator's flight state (may be null) and this collective's number on it.
  const std::shared_ptr<CommFlight>& comm() const { return comm_; }
  int64_t comm_seq() const { return comm_seq_; }

 private:
  template <typename F>
  void Update(F f) {
    std::lock_guard<std::mutex> lock(g_flight_mutex);
    if (g_ring.empty()) return;
    FlightEntry& e = g_ring[size_t((seq_ - 1) % int64_t(g_ring.size()))];
    if (e.seq == seq_) f(e);
  }

  int64_t seq_ = 0;
  std::shared_ptr<CommFlight> comm_;
  int64_t comm_seq_ = 0;
  bool recording_ = false;
};

// The agreement check: one tiny allreduce by which every rank learns whether
// all ranks are about to run the same collective on tensors of the same dtype
// and shape. It is non-blocking so that a collective with work to do before
// its MPI call (the fused allreduce's packing) overlaps the two: the ranks'
// meeting in the check then costs no more than the packing it hides behind.
// On disagreement all ranks gather each other's descriptions and fail with the
// same message, before any rank issues the data collective.
class Agreement {
 public:
  Agreement(MPI_Comm comm, Kind kind, DataType dtype, int64_t param, Shapes shapes)
      : comm_(comm), kind_(kind), dtype_(dtype), param_(param), shapes_(std::move(shapes)),
        hash_(g_check.load(std::memory_order_relaxed) ||
                      g_flight_capacity.load(std::memory_order_relaxed) > 0
                  ? SignatureHash(kind_, dtype_, param_, shapes_)
                  : 0),
        flight_(comm_, kind_, dtype_, param_, shapes_, hash_) {}
  Agreement(const Agreement&) = delete;
  Agreement& operator=(const Agreement&) = delete;
  ~Agreement() {   // a started check is always completed, even on an early return
    if (request_ != MPI_REQUEST_NULL) MPI_Wait(&request_, MPI_STATUS_IGNORE);
  }

  Status Start() {
    if (!g_check.load(std::memory_order_relaxed)) return Status::Ok();
    // non-negative, so -h cannot overflow
    const int64_t h = int64_t(hash_ >> 2);
    v_[0] = h;
    v_[1] = -h;
    MATEX_COLL(MPI_Iallreduce(MPI_IN_PLACE, v_, 2, MPI_INT64_T, MPI_MAX, comm_, &request_),
               "MPI_Iallreduce (agreement check)");
    return Status::Ok();
  }

  Status Finish() {
    if (request_ == MPI_REQUEST_NULL) return Status::Ok();   // check off
    MATEX_MPI(MPI_Wait(&request_, MPI_STATUS_IGNORE), "MPI_Wait (agreement check)");
    flight_.Agreed();
    if (v_[0] == -v_[1]) return Status::Ok();
    const int kLen = 160;
    int size = 0;
    MATEX_MPI(MPI_Comm_size(comm_, &size), "MPI_Comm_size");
    std::vector<char> mine(kLen, 0), all(size_t(kLen) * size, 0);
    std::strncpy(mine.data(), SignatureText(kind_, dtype_, param_, shapes_).c_str(), kLen - 1);
    MATEX_COLL(MPI_Allgather(mine.data(), kLen, MPI_CHAR, all.data(), kLen,
                            MPI_CHAR, comm_),
              "MPI_Allgather (agreement report)");
    std::ostringstream msg;
    msg << "ranks disagree on the collective to run (a different op, dtype or "
           "shape on some rank, or collectives issued in a different order): ";
    for (int r = 0; r < size; ++r) {
      msg << (r ? "; " : "") << "rank " << r << ": "
          << std::string(all.data() + size_t(r) * kLen);
    }
    return Status::Mismatch(msg.str());
  }

  // The check with nothing to overlap: start and finish at once.
  Status Agree() {
    Status s = Start();
    if (!s.ok()) return s;
    return Finish();
  }

  // Close the flight entry with the collective's outcome; returns `s`.
  Status Done(Status s) { return flight_.Done(std::move(s)); }

  // Record `bytes` as what this rank sent in the flight entry (default: its input's bytes).
  void SetBytes(int64_t bytes) { flight_.SetBytes(bytes); }

  const FlightRecord& flight() const { return flight_; }

 private:
  MPI_Comm comm_;
  Kind kind_;
  DataType dtype_;
  int64_t param_;
  Shapes shapes_;
  uint64_t hash_;
  FlightRecord flight_;
  int64_t v_[2] = {0, 0};
  MPI_Request request_ = MPI_REQUEST_NULL;
};

}  // namespace internal
}  // namespace matex

#endif  // MATEX_CORE_INTERNAL_H_
