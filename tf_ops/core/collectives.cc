// MPI collectives of the MaTEx core. See matex_core.h for the contract.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <signal.h>

#include <chrono>
#include <climits>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <type_traits>

#include "half.h"
#include "internal.h"

namespace matex {
namespace internal {

std::mutex g_comm_mutex;              // guards g_comms and the three below
std::intptr_t g_comms[kMaxCommSlots] = {0};
std::shared_ptr<CommFlight> g_comm_flights[kMaxCommSlots];   // each slot's flight state
std::vector<std::shared_ptr<CommFlight>> g_retired;         // the last ones replaced
std::map<uint64_t, int64_t> g_installed;   // members' hash -> communicators installed with them
constexpr size_t kRetiredKept = 16;
std::mutex g_collective_mutexes[kMaxCommSlots];   // one collective at a time per communicator
std::atomic<bool> g_check{true};
std::atomic<int64_t> g_calls{0};

std::mutex& CollectiveMutex(int slot) { return g_collective_mutexes[slot]; }

// MPI_Comm is a pointer in Open MPI and an int in MPICH; mpi4py hands either
// over as an integer.
template <typename C>
C HandleTo(std::intptr_t handle) {
  if constexpr (std::is_pointer<C>::value) {
    return reinterpret_cast<C>(handle);
  } else {
    return static_cast<C>(handle);
  }
}

MPI_Comm ToComm(std::intptr_t handle) { return HandleTo<MPI_Comm>(handle); }

Status MpiFailure(int rc, const char* what) {
  int cls = rc;
  MPI_Error_class(rc, &cls);
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  std::ostringstream msg;
  msg << what << " failed: " << std::string(text, len) << " (MPI error class "
      << cls << ")";
  return Status::Mpi(cls, msg.str());
}

void CountCall() { g_calls.fetch_add(1, std::memory_order_relaxed); }

// FNV-1a over `n` bytes, continuing from `h`.
uint64_t Fnv(uint64_t h, const void* data, size_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ULL;
  }
  return h;
}

// A new communicator's flight state (caller holds g_comm_mutex). Only local
// MPI calls: its members' world ranks, and this process's count of
// communicators with those members (every member installs the same ones, in
// the same order, since making a communicator is collective).
std::shared_ptr<CommFlight> NewCommFlight(MPI_Comm comm) {
  auto f = std::make_shared<CommFlight>();
  MPI_Group group, world;
  int size = 0;
  if (MPI_Comm_size(comm, &size) == MPI_SUCCESS && size > 0 &&
      MPI_Comm_group(comm, &group) == MPI_SUCCESS) {
    if (MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS) {
      std::vector<int> ranks(size_t(size), 0);
      for (int i = 0; i < size; ++i) ranks[size_t(i)] = i;
      f->members.assign(size_t(size), MPI_UNDEFINED);
      if (MPI_Group_translate_ranks(group, size, ranks.data(), world,
                                    f->members.data()) != MPI_SUCCESS) {
        f->members.clear();
      }
      MPI_Group_free(&world);
    }
    MPI_Group_free(&group);
  }
  uint64_t h = Fnv(1469598103934665603ULL, f->members.data(),
                   f->members.size() * sizeof(int));
  const int64_t count = ++g_installed[h];
  f->id = Fnv(h, &count, sizeof(count));
  return f;
}

std::shared_ptr<CommFlight> CommFlightOf(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(g_comm_mutex);
  for (int s = 0; s < kMaxCommSlots; ++s) {
    if (g_comms[s] != 0 && HandleTo<MPI_Comm>(g_comms[s]) == comm) return g_comm_flights[s];
  }
  return nullptr;
}

Status CurrentComm(MPI_Comm* comm, int slot) {
  if (slot < 0 || slot >= kMaxCommSlots) {
    return Status::Invalid("communicator slot " + std::to_string(slot) +
                           " is out of range [0, " + std::to_string(kMaxCommSlots) + ")");
  }
  std::intptr_t handle;
  {
    std::lock_guard<std::mutex> lock(g_comm_mutex);
    handle = g_comms[slot];
  }
  if (handle == 0) {
    return Status::Invalid(
        slot == 0 ? std::string("no communicator set: call matex.init() before using the ops")
                  : "no communicator in slot " + std::to_string(slot) +
                        " (a sub-communicator that was freed or never registered)");
  }
  *comm = ToComm(handle);
  return Status::Ok();
}

// ---- reduction operators for 16-bit floats (MPI has none) ----------------

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), int kOp>
void HalfReduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = ToF(a[i]), y = ToF(b[i]);
    float r = kOp == 0   ? x + y
              : kOp == 1 ? std::min(x, y)
              : kOp == 2 ? std::max(x, y)
                         : x * y;
    b[i] = FromF(r);
  }
}

struct HalfOps {   // sum, min, max, product
  MPI_Op f16[4];
  MPI_Op bf16[4];
};

const HalfOps& GetHalfOps() {
  static HalfOps ops = [] {
    HalfOps h;
    using namespace half;
    MPI_Op_create(&HalfReduce<Float16ToFloat, FloatToFloat16, 0>, 1, &h.f16[0]);
    MPI_Op_create(&HalfReduce<Float16ToFloat, FloatToFloat16, 1>, 1, &h.f16[1]);
    MPI_Op_create(&HalfReduce<Float16ToFloat, FloatToFloat16, 2>, 1, &h.f16[2]);
    MPI_Op_create(&HalfReduce<Float16ToFloat, FloatToFloat16, 3>, 1, &h.f16[3]);
    MPI_Op_create(&HalfReduce<BFloat16ToFloat, FloatToBFloat16, 0>, 1, &h.bf16[0]);
    MPI_Op_create(&HalfReduce<BFloat16ToFloat, FloatToBFloat16, 1>, 1, &h.bf16[1]);
    MPI_Op_create(&HalfReduce<BFloat16ToFloat, FloatToBFloat16, 2>, 1, &h.bf16[2]);
    MPI_Op_create(&HalfReduce<BFloat16ToFloat, FloatToBFloat16, 3>, 1, &h.bf16[3]);
    return h;
  }();
  return ops;
}

MPI_Datatype MpiType(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16:
    case DataType::kBFloat16: return MPI_UINT16_T;
    case DataType::kFloat32: return MPI_FLOAT;
    case DataType::kFloat64: return MPI_DOUBLE;
    case DataType::kInt32: return MPI_INT32_T;
    case DataType::kInt64: return MPI_INT64_T;
    case DataType::kUInt8:
    case DataType::kBool: return MPI_UINT8_T;
    case DataType::kInt8: return MPI_INT8_T;
    case DataType::kUInt16: return MPI_UINT16_T;
    case DataType::kInt16: return MPI_INT16_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op MpiOp(DataType dtype, ReduceOp op) {
  int k = (op == ReduceOp::kMin) ? 1 : (op == ReduceOp::kMax) ? 2 : (op == ReduceOp::kProduct) ? 3 : 0;
  if (dtype == DataType::kFloat16) return GetHalfOps().f16[k];
  if (dtype == DataType::kBFloat16) return GetHalfOps().bf16[k];
  static const MPI_Op kOps[4] = {MPI_SUM, MPI_MIN, MPI_MAX, MPI_PROD};
  return kOps[k];
}

// Divide a summed buffer by the number of ranks (integers truncate, as C does).
template <typename T>
void DivideBy(T* p, int64_t n, int size) {
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / size);
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void DivideHalf(uint16_t* p, int64_t n, int size) {
  for (int64_t i = 0; i < n; ++i) p[i] = FromF(ToF(p[i]) / float(size));
}

void Average(void* data, int64_t n, DataType dtype, int size) {
  if (size == 1) return;
  switch (dtype) {
    case DataType::kFloat16:
      DivideHalf<half::Float16ToFloat, half::FloatToFloat16>(
          static_cast<uint16_t*>(data), n, size);
      break;
    case DataType::kBFloat16:
      DivideHalf<half::BFloat16ToFloat, half::FloatToBFloat16>(
          static_cast<uint16_t*>(data), n, size);
      break;
    case DataType::kFloat32: DivideBy(static_cast<float*>(data), n, size); break;
    case DataType::kFloat64: DivideBy(static_cast<double*>(data), n, size); break;
    case DataType::kInt32: DivideBy(static_cast<int32_t*>(data), n, size); break;
    case DataType::kInt64: DivideBy(static_cast<int64_t*>(data), n, size); break;
    case DataType::kUInt8:
    case DataType::kBool: DivideBy(static_cast<uint8_t*>(data), n, size); break;
    case DataType::kInt8: DivideBy(static_cast<int8_t*>(data), n, size); break;
    case DataType::kUInt16: DivideBy(static_cast<uint16_t*>(data), n, size); break;
    case DataType::kInt16: DivideBy(static_cast<int16_t*>(data), n, size); break;
  }
}

// Allreduce of `count` elements from `in` into `data` (in place when they
// are the same buffer: no copy either way), in chunks that fit MPI's int
// count; kAverage then divides by the communicator size.
Status AllreduceInto(MPI_Comm comm, const void* in, void* data, int64_t count,
                     DataType dtype, ReduceOp op) {
  const size_t esize = DataTypeSize(dtype);
  const int64_t kChunk = INT_MAX / 2;
  char* p = static_cast<char*>(data);
  const char* src = static_cast<const char*>(in);
  for (int64_t done = 0; done < count; done += kChunk) {
    int n = static_cast<int>(std::min(kChunk, count - done));
    const void* send = (src == p) ? MPI_IN_PLACE : static_cast<const void*>(src + done * esize);
    MATEX_COLL(MPI_Allreduce(send, p + done * esize, n, MpiType(dtype),
                             MpiOp(dtype, op), comm),
               "MPI_Allreduce");
  }
  if (op == ReduceOp::kAverage) {
    int size = 1;
    MATEX_MPI(MPI_Comm_size(comm, &size), "MPI_Comm_size");
    Average(data, count, dtype, size);
  }
  return Status::Ok();
}

// ---- cross-rank agreement --------------------------------------------------

// FNV-1a hash of what a collective is about to do; equal on every rank that
// runs the same collective on tensors of the same dtype and shape.
uint64_t SignatureHash(Kind kind, DataType dtype, int64_t param, const Shapes& shapes) {
  uint64_t hash = 1469598103934665603ull;
  auto add = [&hash](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      hash ^= uint64_t((v >> (8 * i)) & 0xff);
      hash *= 1099511628211ull;
    }
  };
  add(int64_t(kind));
  add(int64_t(dtype));
  add(param);
  add(int64_t(shapes.size()));
  const bool skip_first = kind == Kind::kAllgather || kind == Kind::kAlltoall;
  for (const auto* shape : shapes) {
    add(int64_t(shape->size()));
    for (size_t i = skip_first ? 1 : 0; i < shape->size(); ++i) add((*shape)[i]);
  }
  return hash;
}

std::string ShapeText(DataType dtype, const std::vector<int64_t>& shape,
                      bool skip_first) {
  std::ostringstream s;
  s << DataTypeName(dtype) << "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s << ",";
    if (i == 0 && skip_first) s << "*"; else s << shape[i];
  }
  s << "]";
  return s.str();
}

// The same, for people: only built when ranks disagree.
std::string SignatureText(Kind kind, DataType dtype, int64_t param, const Shapes& shapes) {
  std::ostringstream t;
  switch (kind) {
    case Kind::kAllreduce: t << "allreduce(" << ReduceOpName(ReduceOp(param)) << ") of "; break;
    case Kind::kFused: t << "fused allreduce(" << ReduceOpName(ReduceOp(param)) << ") of "; break;
    case Kind::kBroadcast: t << "broadcast(root=" << param << ") of "; break;
    case Kind::kAllgather: t << "allgather of "; break;
    case Kind::kSend: t << "send to " << param << " of "; break;
    case Kind::kRecv: t << "receive from " << param << " of "; break;
    case Kind::kSendRecv: t << "send-receive with " << param << " of "; break;
    case Kind::kSparseAllreduce: t << "sparse allreduce of "; break;
    case Kind::kIallreduce: t << "non-blocking allreduce(" << ReduceOpName(ReduceOp(param)) << ") of "; break;
    case Kind::kAlltoall: t << "alltoall of "; break;
    case Kind::kReducescatter: t << "reducescatter(" << ReduceOpName(ReduceOp(param)) << ") of "; break;
    default: t << "collective kind " << int64_t(kind) << " of "; break;
  }
  if (shapes.size() == 1) {
    t << ShapeText(dtype, *shapes[0], kind == Kind::kAllgather || kind == Kind::kAlltoall);
  } else {
    int64_t total = 0;
    for (const auto* s : shapes) {
      int64_t n = 1;
      for (int64_t d : *s) n *= d;
      total += n;
    }
    t << shapes.size() << " " << DataTypeName(dtype) << " tensors (" << total
      << " elements)";
  }
  return t.str();
}

// ---- flight recorder ---------------------------------------------------------

std::mutex g_flight_mutex;                 // guards the ring (read by dumping threads)
std::vector<FlightEntry> g_ring;           // capacity slots; slot = (seq - 1) % capacity
std::atomic<int> g_flight_capacity{0};
std::atomic<int64_t> g_seq{0};
std::atomic<double> g_pending_since{0.0};
thread_local const char* t_site = nullptr;

double Now() {
  return std::chrono::duration<double>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace internal

using namespace internal;

// ---- public API ------------------------------------------------------------

size_t DataTypeSize(DataType dtype) {
  switch (dtype) {
    case DataType::kUInt8:
    case DataType::kInt8:
    case DataType::kBool: return 1;
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kUInt16:
    case DataType::kInt16: return 2;
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
  }
  return 0;
}

const char* DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt8: return "int8";
    case DataType::kUInt16: return "uint16";
    case DataType::kInt16: return "int16";
    case DataType::kBool: return "bool";
  }
  return "?";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAverage: return "average";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProduct: return "product";
  }
  return "?";
}

int64_t TensorRef::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void SetCommunicator(std::intptr_t handle) { SetCommunicatorSlot(0, handle); }
std::intptr_t GetCommunicator() { return GetCommunicatorSlot(0); }

void SetCommunicatorSlot(int slot, std::intptr_t handle) {
  if (slot < 0 || slot >= kMaxCommSlots) return;
  std::lock_guard<std::mutex> lock(g_comm_mutex);
  if (g_comms[slot] == handle) return;   // the same communicator again: same flight state
  std::shared_ptr<CommFlight> old = std::move(g_comm_flights[slot]);
  g_comms[slot] = handle;
  g_comm_flights[slot] = nullptr;
  if (handle != 0) {
    for (int s = 0; s < kMaxCommSlots; ++s) {   // already in another slot: one communicator
      if (s != slot && g_comms[s] == handle) g_comm_flights[slot] = g_comm_flights[s];
    }
    if (!g_comm_flights[slot]) g_comm_flights[slot] = NewCommFlight(ToComm(handle));
  }
  if (old) {
    for (int s = 0; s < kMaxCommSlots; ++s) {
      if (g_comm_flights[s] == old) return;   // still in use
    }
    old->current = false;
    g_retired.push_back(old);
    if (g_retired.size() > kRetiredKept) g_retired.erase(g_retired.begin());
  }
}

std::intptr_t GetCommunicatorSlot(int slot) {
  if (slot < 0 || slot >= kMaxCommSlots) return 0;
  std::lock_guard<std::mutex> lock(g_comm_mutex);
  return g_comms[slot];
}

void SetAgreementCheck(bool enabled) { g_check.store(enabled); }
bool AgreementCheck() { return g_check.load(); }
int64_t CollectiveCallCount() { return g_calls.load(); }

void SetFlightCapacity(int capacity) {
  std::lock_guard<std::mutex> lock(g_flight_mutex);
  g_ring.assign(size_t(std::max(capacity, 0)), FlightEntry());
  g_flight_capacity.store(std::max(capacity, 0));
}

int FlightCapacity() { return g_flight_capacity.load(); }

std::vector<FlightEntry> FlightEntries() {
  std::vector<FlightEntry> out;
  std::lock_guard<std::mutex> lock(g_flight_mutex);
  for (const FlightEntry& e : g_ring) {
    if (e.seq > 0) out.push_back(e);
  }
  std::sort(out.begin(), out.end(),
            [](const FlightEntry& a, const FlightEntry& b) { return a.seq < b.seq; });
  return out;
}

std::vector<FlightComm> FlightComms() {
  std::vector<FlightComm> out;
  std::lock_guard<std::mutex> lock(g_comm_mutex);
  auto add = [&](const std::shared_ptr<CommFlight>& f, int slot) {
    for (FlightComm& c : out) {
      if (c.id == f->id && c.current == f->current) {
        if (slot >= 0) c.slots.push_back(slot);
        return;
      }
    }
    FlightComm c;
    c.id = f->id;
    c.members = f->members;
    c.seq = f->seq.load(std::memory_order_relaxed);
    c.pending_seq = f->pending_seq.load(std::memory_order_relaxed);
    c.pending_since = f->pending_since.load(std::memory_order_relaxed);
    c.current = f->current;
    if (slot >= 0) c.slots.push_back(slot);
    out.push_back(std::move(c));
  };
  for (int s = 0; s < kMaxCommSlots; ++s) {
    if (g_comm_flights[s]) add(g_comm_flights[s], s);
  }
  for (auto it = g_retired.rbegin(); it != g_retired.rend(); ++it) add(*it, -1);
  return out;
}

int64_t FlightSequence() { return g_seq.load(std::memory_order_relaxed); }
double FlightPendingSince() { return g_pending_since.load(std::memory_order_relaxed); }
void SetFlightSite(const char* site) { t_site = site; }

namespace {
std::atomic<int> g_flight_signal{0};   // lock-free: safe to set from a signal handler
extern "C" void OnFlightSignal(int) { g_flight_signal.store(1); }
}  // namespace

bool InstallFlightSignal(int signum) {
  struct sigaction old;
  if (sigaction(signum, nullptr, &old) != 0) return false;
  if (old.sa_handler == &OnFlightSignal) return true;
  if ((old.sa_flags & SA_SIGINFO) || old.sa_handler != SIG_DFL) return false;   // taken
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = &OnFlightSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  return sigaction(signum, &sa, nullptr) == 0;
}

bool TakeFlightSignal() { return g_flight_signal.exchange(0) != 0; }

Status CommInfo(int* rank, int* size, int slot) {
  MPI_Comm comm;
  Status s = CurrentComm(&comm, slot);
  if (!s.ok()) return s;
  int rc = MPI_Comm_rank(comm, rank);
  if (rc != MPI_SUCCESS) return MpiFailure(rc, "MPI_Comm_rank");
  rc = MPI_Comm_size(comm, size);
  if (rc != MPI_SUCCESS) return MpiFailure(rc, "MPI_Comm_size");
  return Status::Ok();
}

Status Allreduce(const TensorRef& in, void* out, DataType dtype, ReduceOp op, int slot) {
  MPI_Comm comm;
  Status s = CurrentComm(&comm, slot);
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> serial(CollectiveMutex(slot));
  if (!s.ok()) return s;
  Agreement check(comm, Kind::kAllreduce, dtype, int64_t(op), {&in.shape});
  return check.Done([&] {
    Status st = check.Agree();
    if (!st.ok()) return st;
    const int64_t n = in.num_elements();
    if (n == 0) return Status::Ok();
    return AllreduceInto(comm, in.data, out, n, dtype, op);
  }());
}

Status FusedAllreduce(const std::vector<TensorRef>& ins,
                      const std::vector<void*>& outs, DataType dtype,
                      ReduceOp op, void* scratch, int slot) {
  if (ins.size() != outs.size()) {
    return Status::Invalid("fused allreduce: inputs and outputs differ in number");
  }
  MPI_Comm comm;
  Status s = CurrentComm(&comm, slot);
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> serial(CollectiveMutex(slot));
  if (!s.ok()) return s;
  Shapes shapes;
  for (const auto& t : ins) shapes.push_back(&t.shape);
  Agreement check(comm, Kind::kFused, dtype, int64_t(op), shapes);
  return check.Done([&] {
  Status s = check.Start();   // packing below overlaps the check
  if (!s.ok()) return s;
  const size_t esize = DataTypeSize(dtype);
  int64_t total = 0;
  for (const auto& t : ins) total += t.num_elements();
  char* buf = static_cast<char*>(scratch);
  int64_t off = 0;
  for (const auto& t : ins) {
    size_t bytes = size_t(t.num_elements()) * esize;
    if (bytes) std::memcpy(buf + off, t.data, bytes);
    off += int64_t(bytes);
  }
  s = check.Finish();
  if (!s.ok() || total == 0) return s;
  s = AllreduceInto(comm, buf, buf, total, dtype, op);
  if (!s.ok()) return s;
  off = 0;
  for (size_t i = 0; i < ins.size(); ++i) {
    size_t bytes = size_t(ins[i].num_elements()) * esize;
    if (bytes) std::memcpy(outs[i], buf + off, bytes);
    off += int64_t(bytes);
  }
  return Status::Ok();
  }());
}

Status Broadcast(void* data, const std::vector<int64_t>& shape, DataType dtype,
                 int root, int slot) {
  MPI_Comm comm;
  Status s = CurrentComm(&comm, slot);
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> serial(CollectiveMutex(slot));
  if (!s.ok()) return s;
  int size = 0;
  MATEX_MPI(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  if (root < 0 || root >= size) {
    // Every rank sees the same root and size, so every rank fails alike.
    return Status::Invalid("broadcast root " + std::to_string(root) +
                           " is not a rank of a communicator of size " +
                           std::to_string(size));
  }
  Agreement check(comm, Kind::kBroadcast, dtype, root, {&shape});
  return check.Done([&] {
  Status s = check.Agree();
  if (!s.ok()) return s;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  int64_t bytes = n * int64_t(DataTypeSize(dtype));
  char* p = static_cast<char*>(data);
  const int64_t kChunk = INT_MAX / 2;
  for (int64_t done = 0; done < bytes; done += kChunk) {
    int len = static_cast<int>(std::min(kChunk, bytes - done));
    MATEX_COLL(MPI_Bcast(p + done, len, MPI_BYTE, root, comm), "MPI_Bcast");
  }
  return Status::Ok();
  }());
}

Status Allgather(const TensorRef& in, DataType dtype,
                 const std::function<void*(int64_t total_rows)>& allocate,
                 std::vector<int64_t>* first_dims, int slot) {
  if (in.shape.empty()) {
    return Status::Invalid("allgather needs a tensor of rank >= 1 (got a scalar)");
  }
  MPI_Comm comm;
  Status s = CurrentComm(&comm, slot);
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> serial(CollectiveMutex(slot));
  if (!s.ok()) return s;
  Agreement check(comm, Kind::kAllgather, dtype, 0, {&in.shape});
  return check.Done([&] {
  Status s = check.Agree();
  if (!s.ok()) return s;
  int size = 0;
  MATEX_MPI(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  first_dims->assign(size, 0);
  int64_t mine = in.shape[0];
  MATEX_COLL(MPI_Allgather(&mine, 1, MPI_INT64_T, first_dims->data(), 1,
                           MPI_INT64_T, comm),
             "MPI_Allgather (sizes)");
  int64_t row_elems = 1;
  for (size_t i = 1; i < in.shape.size(); ++i) row_elems *= in.shape[i];
  const int64_t row_bytes = row_elems * int64_t(DataTypeSize(dtype));
  std::vector<int> counts(size), displs(size);
  int64_t total = 0;
  for (int r = 0; r < size; ++r) {
    if ((*first_dims)[r] > INT_MAX || total > INT_MAX || row_bytes > INT_MAX) {
      return Status::Invalid("allgather: more than 2^31 rows or a row over 2 GiB");
    }
    counts[r] = int((*first_dims)[r]);
    displs[r] = int(total);
    total += (*first_dims)[r];
  }
  void* out = allocate(total);
  if (out == nullptr) return Status::Invalid("allgather: output allocation failed");
  if (row_bytes == 0 || total == 0) return Status::Ok();
  MPI_Datatype row;
  MATEX_MPI(MPI_Type_contiguous(int(row_bytes), MPI_BYTE, &row), "MPI_Type_contiguous");
  MATEX_MPI(MPI_Type_commit(&row), "MPI_Type_commit");
  CountCall();
  int rc = MPI_Allgatherv(in.data, int(in.shape[0]), row, out, counts.data(),
                          displs.data(), row, comm);
  MPI_Type_free(&row);
  if (rc != MPI_SUCCESS) return MpiFailure(rc, "MPI_Allgatherv");
  return Status::Ok();
  }());
}

namespace {

// A contiguous MPI datatype of `row_bytes` bytes (one row of a tensor), freed
// when it goes out of scope.
class RowType {
 public:
  Status Make(int64_t row_bytes) {
    MATEX_MPI(MPI_Type_contiguous(int(row_bytes), MPI_BYTE, &type_), "MPI_Type_contiguous");
    MATEX_MPI(MPI_Type_commit(&type_), "MPI_Type_commit");
    return Status::Ok();
  }
  ~RowType() {
    if (type_ != MPI_DATATYPE_NULL) MPI_Type_free(&type_);
  }
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

int64_t RowElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

// This rank's send counts for an alltoall of `rows` rows, or why `splits`
// are not valid ("" when they are).
std::string AlltoallCounts(const std::vector<int64_t>& splits, int64_t rows, int size,
                           std::vector<int64_t>* send) {
  send->assign(size_t(size), 0);
  if (splits.empty()) {
    if (rows % size != 0) {
      return "the first dimension " + std::to_string(rows) + " does not split equally over " +
             std::to_string(size) + " ranks (pass splits)";
    }
    std::fill(send->begin(), send->end(), rows / size);
    return "";
  }
  if (splits.size() != size_t(size)) {
    return std::to_string(splits.size()) + " splits for " + std::to_string(size) + " ranks";
  }
  int64_t total = 0;
  for (int64_t v : splits) {
    if (v < 0) return "a negative split (" + std::to_string(v) + ")";
    total += v;
  }
  if (total != rows) {
    return "splits sum to " + std::to_string(total) + ", not to the first dimension " +
           std::to_string(rows);
  }
  *send = splits;
  return "";
}

}  // namespace

Status Alltoall(const TensorRef& in, const std::vector<int64_t>& splits, DataType dtype,
                const std::function<void*(int64_t total_rows)>& allocate,
                std::vector<int64_t>* recv_splits, int slot) {
  MPI_Comm comm;
  Status s = CurrentComm(&comm, slot);
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> serial(CollectiveMutex(slot));
  Agreement check(comm, Kind::kAlltoall, dtype, 0, {&in.shape});
  return check.Done([&] {
  Status s = check.Agree();   // same dtype and rank, same dims but the first
  if (!s.ok()) return s;
  if (in.shape.empty()) {     // then a scalar on every rank
    return Status::Invalid("alltoall needs a tensor of rank >= 1 (got a scalar)");
  }
  int size = 0, rank = 0;
  MATEX_MPI(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  MATEX_MPI(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  const int64_t row_bytes = RowElements(in.shape) * int64_t(DataTypeSize(dtype));
  std::vector<int64_t> send;
  std::string why = AlltoallCounts(splits, in.shape[0], size, &send);
  if (why.empty() && (in.shape[0] > INT_MAX || row_bytes > INT_MAX)) {
    why = "more than 2^31 rows or a row over 2 GiB";
  }
  // Every rank learns every rank's splits (a rank with invalid ones sends -1s):
  // then every rank knows alike whether the call can go on, and on failure
  // they exchange their reasons for one common message.
  if (!why.empty()) std::fill(send.begin(), send.end(), int64_t(-1));
  std::vector<int64_t> table(size_t(size) * size, 0);   // row j: rank j's splits
  MATEX_COLL(MPI_Allgather(send.data(), size, MPI_INT64_T, table.data(), size, MPI_INT64_T,
                           comm),
             "MPI_Allgather (alltoall splits)");
  bool failed = false;
  for (int r = 0; r < size && !failed; ++r) {
    int64_t received = 0;
    for (int j = 0; j < size; ++j) {
      const int64_t v = table[size_t(j) * size + r];
      if (v < 0) failed = true;
      received += v;
    }
    if (received > INT_MAX) failed = true;
  }
  recv_splits->assign(size_t(size), 0);
  int64_t total = 0;
  for (int j = 0; j < size; ++j) {
    (*recv_splits)[size_t(j)] = std::max<int64_t>(table[size_t(j) * size + rank], 0);
    total += (*recv_splits)[size_t(j)];
  }
  if (failed) {
    if (why.empty() && total > INT_MAX) why = "more than 2^31 rows to receive";
    const int kLen = 160;
    std::vector<char> mine(kLen, 0), all(size_t(kLen) * size, 0);
    std::strncpy(mine.data(), why.c_str(), kLen - 1);
    MATEX_COLL(MPI_Allgather(mine.data(), kLen, MPI_CHAR, all.data(), kLen, MPI_CHAR, comm),
               "MPI_Allgather (alltoall splits report)");
    std::ostringstream msg;
    msg << "invalid splits on";
    bool first = true;
    for (int r = 0; r < size; ++r) {
      const char* text = all.data() + size_t(r) * kLen;
      if (!*text) continue;
      msg << (first ? " " : "; ") << "rank " << r << ": " << text;
      first = false;
    }
    return Status::Invalid(msg.str());
  }
  void* out = allocate(total);
  if (out == nullptr) return Status::Invalid("alltoall: output allocation failed");
  if (row_bytes == 0) return Status::Ok();
  std::vector<int> scounts(size), sdispls(size), rcounts(size), rdispls(size);
  int64_t soff = 0, roff = 0;
  for (int r = 0; r < size; ++r) {
    scounts[r] = int(send[size_t(r)]);
    sdispls[r] = int(soff);
    soff += send[size_t(r)];
    rcounts[r] = int((*recv_splits)[size_t(r)]);
    rdispls[r] = int(roff);
    roff += (*recv_splits)[size_t(r)];
  }
  RowType row;
  s = row.Make(row_bytes);
  if (!s.ok()) return s;
  MATEX_COLL(MPI_Alltoallv(in.data, scounts.data(), sdispls.data(), row.get(), out,
                           rcounts.data(), rdispls.data(), row.get(), comm),
             "MPI_Alltoallv");
  return Status::Ok();
  }());
}

Status Reducescatter(const TensorRef& in, DataType dtype, ReduceOp op,
                     const std::function<void*(int64_t rows)>& allocate, int slot) {
  MPI_Comm comm;
  Status s = CurrentComm(&comm, slot);
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> serial(CollectiveMutex(slot));
  Agreement check(comm, Kind::kReducescatter, dtype, int64_t(op), {&in.shape});
  return check.Done([&] {
  Status s = check.Agree();   // then every rank has the same shape
  if (!s.ok()) return s;
  if (in.shape.empty()) {
    return Status::Invalid("reducescatter needs a tensor of rank >= 1 (got a scalar)");
  }
  int size = 0, rank = 0;
  MATEX_MPI(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  MATEX_MPI(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  if (in.num_elements() > INT_MAX) {
    return Status::Invalid("reducescatter: more than 2^31 elements");
  }
  const int64_t rows = in.shape[0], row_elems = RowElements(in.shape);
  std::vector<int> counts(size);
  for (int r = 0; r < size; ++r) {
    counts[r] = int((rows / size + (r < rows % size ? 1 : 0)) * row_elems);
  }
  const int64_t my_rows = rows / size + (rank < rows % size ? 1 : 0);
  void* out = allocate(my_rows);
  if (out == nullptr) return Status::Invalid("reducescatter: output allocation failed");
  if (in.num_elements() == 0) return Status::Ok();
  MATEX_COLL(MPI_Reduce_scatter(in.data, out, counts.data(), MpiType(dtype), MpiOp(dtype, op),
                                comm),
             "MPI_Reduce_scatter");
  if (op == ReduceOp::kAverage) Average(out, int64_t(counts[rank]), dtype, size);
  return Status::Ok();
  }());
}

}  // namespace matex
