// Point-to-point transfers of the MaTEx core (declared in p2p.h): a pairwise
// header exchange (the point-to-point form of the agreement check), then the
// data, all with non-blocking MPI waited for outside any lock.
#include "p2p.h"

#include <climits>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "internal.h"

namespace matex {
namespace {

using namespace internal;

// What one side is about to move: dtype, rank, element count, the first 8
// dimensions and a hash of the whole shape. Equal headers: same transfer.
constexpr int kHeaderLen = 13;
struct Header {
  int64_t v[kHeaderLen] = {0};
};

Header Describe(DataType dtype, const std::vector<int64_t>& shape) {
  Header h;
  h.v[0] = 0x4d61544578503250;   // "MaTExP2P": a stray message is not mistaken for a header
  h.v[1] = int64_t(dtype);
  h.v[2] = int64_t(shape.size());
  int64_t n = 1;
  uint64_t hash = 1469598103934665603ull;
  for (size_t i = 0; i < shape.size(); ++i) {
    n *= shape[i];
    if (i < 8) h.v[4 + i] = shape[i];
    hash = (hash ^ uint64_t(shape[i])) * 1099511628211ull;
  }
  h.v[3] = n;
  h.v[12] = int64_t(hash >> 1);
  return h;
}

std::string HeaderText(const Header& h) {
  if (h.v[0] != 0x4d61544578503250) return "an unrecognised message";
  std::ostringstream s;
  const int64_t dtype = h.v[1];
  s << (dtype >= 0 && dtype <= 5 ? DataTypeName(DataType(dtype)) : "?") << "[";
  for (int64_t i = 0; i < h.v[2]; ++i) {
    if (i) s << ",";
    if (i == 8) { s << "..."; break; }
    s << h.v[4 + i];
  }
  s << "]";
  return s.str();
}

bool Same(const Header& a, const Header& b) {
  return std::memcmp(a.v, b.v, sizeof(a.v)) == 0;
}

// MPI tags of a user tag's channel.
int HeaderTag(int tag) { return 3 * tag; }
int ReplyTag(int tag) { return 3 * tag + 1; }
int DataTag(int tag) { return 3 * tag + 2; }

// Held only while requests are posted, never while waiting: posting the
// messages of one step of a transfer is atomic with respect to other threads.
std::mutex& PostMutex(int slot) {
  static std::mutex mutexes[kMaxCommSlots];
  return mutexes[slot];
}

// One direction of a transfer as this rank sees it.
struct Leg {
  bool sending;
  int peer;
  DataType dtype;
  const std::vector<int64_t>* shape;
  char* data;
  Header mine, theirs;
  bool agreed = true;
  int64_t bytes() const {
    int64_t n = 1;
    for (int64_t d : *shape) n *= d;
    return n * int64_t(DataTypeSize(dtype));
  }
};

// Give up on requests that will not be waited for (receives cancelled, so
// nothing writes into a buffer after the op returned).
void Release(std::vector<MPI_Request>* requests) {
  for (auto& r : *requests) {
    if (r != MPI_REQUEST_NULL) {
      MPI_Cancel(&r);
      MPI_Request_free(&r);
    }
  }
  requests->clear();
}

// Wait for every request; on failure release the rest (receives cancelled)
// and report the first real error.
Status WaitAll(std::vector<MPI_Request>* requests, const char* what) {
  if (requests->empty()) return Status::Ok();
  std::vector<MPI_Status> statuses(requests->size());
  CountCall();
  int rc = MPI_Waitall(int(requests->size()), requests->data(), statuses.data());
  if (rc == MPI_SUCCESS) {
    requests->clear();
    return Status::Ok();
  }
  int first = rc;
  if (rc == MPI_ERR_IN_STATUS) {
    for (const auto& st : statuses) {
      if (st.MPI_ERROR != MPI_SUCCESS && st.MPI_ERROR != MPI_ERR_PENDING) {
        first = st.MPI_ERROR;
        break;
      }
    }
  }
  Release(requests);
  return MpiFailure(first, what);
}

Status PostData(MPI_Comm comm, const Leg& leg, int tag, std::vector<MPI_Request>* requests) {
  const int64_t bytes = leg.bytes();
  const int64_t kChunk = int64_t(1) << 30;
  for (int64_t done = 0; done < bytes; done += kChunk) {
    const int len = int(std::min(kChunk, bytes - done));
    MPI_Request r;
    if (leg.sending) {
      MATEX_MPI(MPI_Isend(leg.data + done, len, MPI_BYTE, leg.peer, DataTag(tag), comm, &r),
                "MPI_Isend");
    } else {
      MATEX_MPI(MPI_Irecv(leg.data + done, len, MPI_BYTE, leg.peer, DataTag(tag), comm, &r),
                "MPI_Irecv");
    }
    requests->push_back(r);
  }
  return Status::Ok();
}

std::string MismatchText(const Leg& leg, int me, int tag, int slot) {
  const Header& sent = leg.sending ? leg.mine : leg.theirs;
  const Header& expected = leg.sending ? leg.theirs : leg.mine;
  const int sender = leg.sending ? me : leg.peer;
  const int receiver = leg.sending ? leg.peer : me;
  std::ostringstream m;
  m << "point-to-point mismatch on communicator slot " << slot << ", tag " << tag
    << ": rank " << sender << " sends " << HeaderText(sent) << " to rank " << receiver
    << ", which receives " << HeaderText(expected) << " from rank " << sender;
  return m.str();
}

Status Transfer(Kind kind, std::vector<Leg>& legs, int tag, int slot) {
  if (tag < 0 || tag >= kMaxP2PTag) {
    return Status::Invalid("point-to-point tag " + std::to_string(tag) +
                           " is out of range [0, " + std::to_string(kMaxP2PTag) + ")");
  }
  MPI_Comm comm;
  Status s = CurrentComm(&comm, slot);
  if (!s.ok()) return s;
  int me = 0, size = 0;
  MATEX_MPI(MPI_Comm_rank(comm, &me), "MPI_Comm_rank");
  MATEX_MPI(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  for (const Leg& leg : legs) {
    if (leg.peer < 0 || leg.peer >= size) {
      return Status::Invalid(std::string(leg.sending ? "send destination " : "receive source ") +
                             std::to_string(leg.peer) +
                             " is not a rank of communicator slot " + std::to_string(slot) +
                             " (size " + std::to_string(size) + ")");
    }
  }
  // One flight entry for the whole transfer. Its signature describes the
  // data of the first leg alone (not who sends), so a send's entry and the
  // matching receive's carry the same signature.
  Shapes shapes;
  for (const Leg& leg : legs) shapes.push_back(leg.shape);
  const Shapes first = {legs[0].shape};
  FlightRecord flight(comm, kind, legs[0].dtype, legs[0].peer, shapes,
                      SignatureHash(Kind::kSend, legs[0].dtype, 0, first),
                      /*ordered=*/false);   // only the peers take part: no communicator order
  return flight.Done([&] {
    std::vector<MPI_Request> requests;
    if (g_check.load(std::memory_order_relaxed)) {
      {
        std::lock_guard<std::mutex> lock(PostMutex(slot));
        for (Leg& leg : legs) {
          MPI_Request r;
          int rc = MPI_Isend(leg.mine.v, kHeaderLen, MPI_INT64_T, leg.peer,
                             leg.sending ? HeaderTag(tag) : ReplyTag(tag), comm, &r);
          if (rc == MPI_SUCCESS) {
            requests.push_back(r);
            rc = MPI_Irecv(leg.theirs.v, kHeaderLen, MPI_INT64_T, leg.peer,
                           leg.sending ? ReplyTag(tag) : HeaderTag(tag), comm, &r);
          }
          if (rc != MPI_SUCCESS) {
            Release(&requests);
            return MpiFailure(rc, "MPI_Isend/MPI_Irecv (point-to-point check)");
          }
          requests.push_back(r);
        }
      }
      Status st = WaitAll(&requests, "MPI_Waitall (point-to-point check)");
      if (!st.ok()) return st;
      flight.Agreed();
      for (Leg& leg : legs) leg.agreed = Same(leg.mine, leg.theirs);
    }
    {
      std::lock_guard<std::mutex> lock(PostMutex(slot));
      for (const Leg& leg : legs) {
        if (!leg.agreed) continue;   // the peer saw the same mismatch: it posts nothing either
        Status st = PostData(comm, leg, tag, &requests);
        if (!st.ok()) {
          Release(&requests);
          return st;
        }
      }
    }
    Status st = WaitAll(&requests, "MPI_Waitall (point-to-point data)");
    if (!st.ok()) return st;
    std::string mismatch;
    for (const Leg& leg : legs) {
      if (leg.agreed) continue;
      mismatch += (mismatch.empty() ? "" : "; ") + MismatchText(leg, me, tag, slot);
    }
    if (!mismatch.empty()) return Status::Mismatch(mismatch);
    return Status::Ok();
  }());
}

Leg MakeLeg(bool sending, int peer, DataType dtype, const std::vector<int64_t>* shape,
            void* data) {
  Leg leg;
  leg.sending = sending;
  leg.peer = peer;
  leg.dtype = dtype;
  leg.shape = shape;
  leg.data = static_cast<char*>(data);
  leg.mine = Describe(dtype, *shape);
  return leg;
}

}  // namespace

Status Send(const TensorRef& in, DataType dtype, int dest, int tag, int slot) {
  std::vector<Leg> legs = {MakeLeg(true, dest, dtype, &in.shape, const_cast<void*>(in.data))};
  return Transfer(Kind::kSend, legs, tag, slot);
}

Status Recv(void* out, const std::vector<int64_t>& shape, DataType dtype, int source,
            int tag, int slot) {
  std::vector<Leg> legs = {MakeLeg(false, source, dtype, &shape, out)};
  return Transfer(Kind::kRecv, legs, tag, slot);
}

Status SendRecv(const TensorRef& in, DataType dtype, int dest, void* out,
                const std::vector<int64_t>& recv_shape, DataType recv_dtype, int source,
                int tag, int slot) {
  std::vector<Leg> legs = {
      MakeLeg(true, dest, dtype, &in.shape, const_cast<void*>(in.data)),
      MakeLeg(false, source, recv_dtype, &recv_shape, out)};
  return Transfer(Kind::kSendRecv, legs, tag, slot);
}

}  // namespace matex
