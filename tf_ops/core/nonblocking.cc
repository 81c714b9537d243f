// Non-blocking allreduce of the MaTEx core (see nonblocking.h).
#include "nonblocking.h"

#include <mpi.h>

#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "internal.h"

namespace matex {
namespace {

using internal::Kind;
using internal::Shapes;

// One posted allreduce: the buffer MPI works in, its requests (one per
// INT_MAX/2-element chunk) and what the caller needs back.
struct Pending {
  std::mutex mpi;                      // one thread in MPI on these requests at a time
  std::vector<MPI_Request> requests;
  std::vector<char> buffer;
  std::vector<std::vector<int64_t>> shapes;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int size = 1;                        // communicator size at start (for kAverage)
  bool done = false;                   // every request completed (guarded by `mpi`)
  Status status;                       // their outcome, once done
  std::shared_ptr<internal::CommFlight> comm;   // its communicator's flight state (may be null)
  int64_t comm_seq = 0;                // its number on that communicator
};

std::mutex g_table_mutex;              // guards the three below
std::map<int64_t, std::shared_ptr<Pending>> g_table;
int64_t g_next_handle = 0;
bool g_thread_running = false;
bool g_stopping = false;               // IallreduceForgetAll: the thread must leave MPI alone
std::condition_variable g_thread_ended;

// Test `p`'s requests once (caller holds p->mpi); sets done/status when all completed.
void TestLocked(Pending* p) {
  if (p->done) return;
  for (auto& r : p->requests) {
    if (r == MPI_REQUEST_NULL) continue;
    int flag = 0;
    int rc = MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      p->status = internal::MpiFailure(rc, "MPI_Iallreduce");
      p->done = true;
      return;
    }
    if (!flag) return;
  }
  p->done = true;
}

// Enters MPI every millisecond while any request is pending, so that the
// transfer advances while the caller computes; ends when none is.
void ProgressLoop() {
  for (;;) {
    std::vector<std::shared_ptr<Pending>> pending;
    {
      std::lock_guard<std::mutex> lock(g_table_mutex);
      for (auto& kv : g_table) pending.push_back(kv.second);
      if (pending.empty() || g_stopping) {
        g_thread_running = false;
        g_thread_ended.notify_all();
        return;
      }
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    for (auto& p : pending) {
      if (finalized) break;
      std::unique_lock<std::mutex> lock(p->mpi, std::try_to_lock);
      if (lock.owns_lock()) TestLocked(p.get());   // else a waiter is in MPI already
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::shared_ptr<Pending> Take(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_table_mutex);
  auto it = g_table.find(handle);
  if (it == g_table.end()) return nullptr;
  auto p = it->second;
  g_table.erase(it);
  return p;
}

// Block until `p` completes (its requests are ours alone once taken from the table).
Status WaitLocked(Pending* p) {
  if (!p->done) {
    for (auto& r : p->requests) {
      if (r == MPI_REQUEST_NULL) continue;
      int rc = MPI_Wait(&r, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        p->status = internal::MpiFailure(rc, "MPI_Iallreduce (wait)");
        break;
      }
    }
    p->done = true;
  }
  return p->status;
}

}  // namespace

Status IallreduceStart(const std::vector<TensorRef>& ins, DataType dtype, ReduceOp op,
                       int slot, int64_t* handle) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAverage) {
    return Status::Invalid("non-blocking allreduce supports sum and average only");
  }
  MPI_Comm comm;
  Status s = internal::CurrentComm(&comm, slot);
  if (!s.ok()) return s;
  auto p = std::make_shared<Pending>();
  p->dtype = dtype;
  p->op = op;
  MATEX_MPI(MPI_Comm_size(comm, &p->size), "MPI_Comm_size");
  Shapes shapes;
  int64_t total = 0;
  for (const auto& t : ins) {
    p->shapes.push_back(t.shape);
    total += t.num_elements();
  }
  for (const auto& shape : p->shapes) shapes.push_back(&shape);
  const size_t esize = DataTypeSize(dtype);
  std::lock_guard<std::mutex> serial(internal::CollectiveMutex(slot));
  internal::Agreement check(comm, Kind::kIallreduce, dtype, int64_t(op), shapes);
  p->comm = check.flight().comm();
  p->comm_seq = check.flight().comm_seq();
  s = check.Done([&] {
    Status s = check.Start();   // packing below overlaps the check
    if (!s.ok()) return s;
    p->buffer.resize(size_t(total) * esize);
    int64_t off = 0;
    for (const auto& t : ins) {
      const size_t bytes = size_t(t.num_elements()) * esize;
      if (bytes) std::memcpy(p->buffer.data() + off, t.data, bytes);
      off += int64_t(bytes);
    }
    s = check.Finish();
    if (!s.ok()) return s;
    const int64_t kChunk = INT_MAX / 2;
    for (int64_t done = 0; done < total; done += kChunk) {
      const int n = static_cast<int>(std::min(kChunk, total - done));
      p->requests.push_back(MPI_REQUEST_NULL);
      MATEX_COLL(MPI_Iallreduce(MPI_IN_PLACE, p->buffer.data() + done * int64_t(esize), n,
                                internal::MpiType(dtype), internal::MpiOp(dtype, op), comm,
                                &p->requests.back()),
                 "MPI_Iallreduce");
    }
    return Status::Ok();
  }());
  if (!s.ok()) {
    // requests already posted (a later chunk failed) must still complete
    for (auto& r : p->requests) {
      if (r != MPI_REQUEST_NULL) MPI_Wait(&r, MPI_STATUS_IGNORE);
    }
    return s;
  }
  if (p->requests.empty()) p->done = true;   // nothing to move
  bool start_thread = false;
  {
    std::lock_guard<std::mutex> lock(g_table_mutex);
    *handle = ++g_next_handle;
    g_table[*handle] = p;
    if (!g_thread_running && !p->done) {
      g_thread_running = true;
      start_thread = true;
    }
  }
  if (start_thread) std::thread(ProgressLoop).detach();
  return Status::Ok();
}

Status IallreduceShapes(int64_t handle, DataType* dtype,
                        std::vector<std::vector<int64_t>>* shapes) {
  std::lock_guard<std::mutex> lock(g_table_mutex);
  auto it = g_table.find(handle);
  if (it == g_table.end()) {
    return Status::Invalid("no pending non-blocking allreduce with handle " +
                           std::to_string(handle) + " (already waited for, or dropped)");
  }
  *dtype = it->second->dtype;
  *shapes = it->second->shapes;
  return Status::Ok();
}

Status IallreduceWait(int64_t handle, const std::vector<void*>& outs,
                      std::vector<std::vector<int64_t>>* shapes_at_start) {
  auto p = Take(handle);
  if (p == nullptr) {
    return Status::Invalid("no pending non-blocking allreduce with handle " +
                           std::to_string(handle) + " (already waited for, or dropped)");
  }
  if (shapes_at_start != nullptr) *shapes_at_start = p->shapes;
  if (outs.size() != p->shapes.size()) {
    std::lock_guard<std::mutex> lock(p->mpi);
    WaitLocked(p.get());   // complete it anyway: the buffer is about to go
    return Status::Invalid("non-blocking allreduce: " + std::to_string(outs.size()) +
                           " outputs for " + std::to_string(p->shapes.size()) + " tensors");
  }
  // The stall inspector sees a wait that never ends as a pending collective
  // (on its communicator, under its number there).
  const double since = internal::Now();
  internal::g_pending_since.store(since, std::memory_order_relaxed);
  if (p->comm && p->comm_seq > 0) {
    p->comm->pending_seq.store(p->comm_seq, std::memory_order_relaxed);
    p->comm->pending_since.store(since, std::memory_order_relaxed);
  }
  Status s;
  {
    std::lock_guard<std::mutex> lock(p->mpi);
    s = WaitLocked(p.get());
  }
  internal::g_pending_since.store(0.0, std::memory_order_relaxed);
  if (p->comm && p->comm_seq > 0) {
    int64_t expected = p->comm_seq;
    if (p->comm->pending_seq.compare_exchange_strong(expected, 0)) {
      p->comm->pending_since.store(0.0, std::memory_order_relaxed);
    }
  }
  if (!s.ok()) return s;
  int64_t total = 0;
  for (const auto& shape : p->shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    total += n;
  }
  if (p->op == ReduceOp::kAverage && total > 0) {
    internal::Average(p->buffer.data(), total, p->dtype, p->size);
  }
  const size_t esize = DataTypeSize(p->dtype);
  int64_t off = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : p->shapes[i]) n *= d;
    const size_t bytes = size_t(n) * esize;
    if (bytes) std::memcpy(outs[i], p->buffer.data() + off, bytes);
    off += int64_t(bytes);
  }
  return Status::Ok();
}

int64_t IallreduceDropAll() {
  std::vector<std::shared_ptr<Pending>> all;
  {
    std::lock_guard<std::mutex> lock(g_table_mutex);
    for (auto& kv : g_table) all.push_back(kv.second);
    g_table.clear();
  }
  for (auto& p : all) {
    std::lock_guard<std::mutex> lock(p->mpi);
    WaitLocked(p.get());   // MPI forbids freeing an active collective request
  }
  return int64_t(all.size());
}

int64_t IallreduceForgetAll() {
  std::unique_lock<std::mutex> lock(g_table_mutex);
  const int64_t n = int64_t(g_table.size());
  g_table.clear();
  g_stopping = true;
  g_thread_ended.wait(lock, [] { return !g_thread_running; });
  g_stopping = false;
  return n;
}

int64_t IallreducePending() {
  std::lock_guard<std::mutex> lock(g_table_mutex);
  return int64_t(g_table.size());
}

}  // namespace matex
