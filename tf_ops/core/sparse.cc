// Sparse allreduce (SparCML): recursive doubling of sorted (index, row)
// streams, summed where indices meet, dense once a stream is dense enough.
// See sparse.h for the contract.
#include "sparse.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <numeric>
#include <string>

#include "half.h"
#include "internal.h"

namespace matex {
namespace {

using internal::Agreement;
using internal::Kind;

constexpr int kTag = 0x5ca;   // point-to-point tag of the exchange (one op at a time per comm)
constexpr int64_t kChunk = int64_t(1) << 30;

// dst[i] = a[i] + b[i] for one row; a and b may alias dst. Commutative in a
// and b, bit for bit (IEEE addition is), which keeps partners identical.
template <typename T>
void AddRow(const void* a, const void* b, void* dst, int64_t n) {
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  T* z = static_cast<T*>(dst);
  for (int64_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void AddHalfRow(const void* a, const void* b, void* dst, int64_t n) {
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  uint16_t* z = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) z[i] = FromF(ToF(x[i]) + ToF(y[i]));
}

using AddFn = void (*)(const void*, const void*, void*, int64_t);

AddFn Adder(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16: return &AddHalfRow<half::Float16ToFloat, half::FloatToFloat16>;
    case DataType::kBFloat16: return &AddHalfRow<half::BFloat16ToFloat, half::FloatToBFloat16>;
    case DataType::kFloat32: return &AddRow<float>;
    case DataType::kFloat64: return &AddRow<double>;
    case DataType::kInt32: return &AddRow<int32_t>;
    case DataType::kInt64: return &AddRow<int64_t>;
    default: break;   // the sparse op takes the types above only
  }
  return nullptr;
}

// A stream: `n` sorted unique rows packed as [n int64 indices][n rows], or
// dense: [dense_rows rows] (no indices).
struct Stream {
  bool dense = false;
  int64_t n = 0;
  std::vector<char> buf;
};

struct Layout {
  int64_t rows;        // dense first dimension
  int64_t row_bytes;
  int64_t row_elems;
  int64_t switch_rows;
  AddFn add;

  int64_t* Index(Stream& s) const { return reinterpret_cast<int64_t*>(s.buf.data()); }
  const int64_t* Index(const Stream& s) const {
    return reinterpret_cast<const int64_t*>(s.buf.data());
  }
  char* Row(Stream& s, int64_t i) const {
    return s.buf.data() + (s.dense ? 0 : s.n * 8) + i * row_bytes;
  }
  const char* Row(const Stream& s, int64_t i) const {
    return s.buf.data() + (s.dense ? 0 : s.n * 8) + i * row_bytes;
  }
  int64_t Bytes(bool dense, int64_t n) const {
    return dense ? rows * row_bytes : n * (8 + row_bytes);
  }

  // A sparse stream of `n` rows, not filled.
  Stream Sparse(int64_t n) const {
    Stream s;
    s.n = n;
    s.buf.resize(size_t(Bytes(false, n)));
    return s;
  }

  Stream ToDense(const Stream& s) const {
    Stream d;
    d.dense = true;
    d.n = rows;
    d.buf.assign(size_t(Bytes(true, rows)), 0);
    const int64_t* idx = Index(s);
    for (int64_t i = 0; i < s.n; ++i) std::memcpy(Row(d, idx[i]), Row(s, i), row_bytes);
    return d;
  }

  Stream MaybeDense(Stream s) const {
    if (!s.dense && s.n >= switch_rows) return ToDense(s);
    return s;
  }

  // a + b; the same bits whichever is `a`.
  Stream Merge(const Stream& a, const Stream& b) const {
    if (a.dense && b.dense) {
      Stream out;
      out.dense = true;
      out.n = rows;
      out.buf.resize(a.buf.size());
      add(a.buf.data(), b.buf.data(), out.buf.data(), rows * row_elems);
      return out;
    }
    if (a.dense || b.dense) {
      const Stream& d = a.dense ? a : b;
      const Stream& s = a.dense ? b : a;
      Stream out = d;
      const int64_t* idx = Index(s);
      for (int64_t i = 0; i < s.n; ++i) {
        char* row = Row(out, idx[i]);
        add(row, Row(s, i), row, row_elems);
      }
      return out;
    }
    const int64_t* ia = Index(a);
    const int64_t* ib = Index(b);
    int64_t union_n = 0;
    for (int64_t i = 0, j = 0; i < a.n || j < b.n; ++union_n) {
      if (j == b.n || (i < a.n && ia[i] < ib[j])) ++i;
      else if (i == a.n || ib[j] < ia[i]) ++j;
      else { ++i; ++j; }
    }
    Stream out = Sparse(union_n);
    int64_t* io = Index(out);
    int64_t k = 0;
    for (int64_t i = 0, j = 0; i < a.n || j < b.n; ++k) {
      if (j == b.n || (i < a.n && ia[i] < ib[j])) {
        io[k] = ia[i];
        std::memcpy(Row(out, k), Row(a, i), row_bytes);
        ++i;
      } else if (i == a.n || ib[j] < ia[i]) {
        io[k] = ib[j];
        std::memcpy(Row(out, k), Row(b, j), row_bytes);
        ++j;
      } else {
        io[k] = ia[i];
        add(Row(a, i), Row(b, j), Row(out, k), row_elems);
        ++i;
        ++j;
      }
    }
    return MaybeDense(std::move(out));
  }
};

// This rank's input as a stream: sorted, duplicates summed in input order.
// Returns false (and an empty stream) when an index is out of range.
bool LocalStream(const int64_t* indices, int64_t nnz, const void* values, const Layout& L,
                 Stream* out, std::string* why) {
  for (int64_t i = 0; i < nnz; ++i) {
    if (indices[i] < 0 || indices[i] >= L.rows) {
      *why = "index " + std::to_string(indices[i]) + " at position " + std::to_string(i) +
             " is outside [0, " + std::to_string(L.rows) + ")";
      *out = L.Sparse(0);
      return false;
    }
  }
  const char* vals = static_cast<const char*>(values);
  bool sorted_unique = true;
  for (int64_t i = 1; i < nnz && sorted_unique; ++i) sorted_unique = indices[i - 1] < indices[i];
  if (sorted_unique) {
    Stream s = L.Sparse(nnz);
    if (nnz) {
      std::memcpy(L.Index(s), indices, size_t(nnz) * 8);
      std::memcpy(L.Row(s, 0), vals, size_t(nnz * L.row_bytes));
    }
    *out = L.MaybeDense(std::move(s));
    return true;
  }
  std::vector<int64_t> order(static_cast<size_t>(nnz));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [indices](int64_t x, int64_t y) { return indices[x] < indices[y]; });
  int64_t unique = 0;
  for (int64_t i = 0; i < nnz; ++i) {
    if (i == 0 || indices[order[i]] != indices[order[i - 1]]) ++unique;
  }
  Stream s = L.Sparse(unique);
  int64_t* idx = L.Index(s);
  int64_t k = -1;
  for (int64_t i = 0; i < nnz; ++i) {
    const int64_t src = order[i];
    const char* row = vals + src * L.row_bytes;
    if (i == 0 || indices[src] != idx[k]) {
      idx[++k] = indices[src];
      std::memcpy(L.Row(s, k), row, size_t(L.row_bytes));
    } else {
      L.add(L.Row(s, k), row, L.Row(s, k), L.row_elems);
    }
  }
  *out = L.MaybeDense(std::move(s));
  return true;
}

// Bytes both ways with one partner, in chunks MPI's int counts can hold.
// Both sides loop max(sent, received) bytes: the same count on each.
Status SendRecvBytes(MPI_Comm comm, int partner, const char* send, int64_t send_bytes,
                     char* recv, int64_t recv_bytes) {
  const int64_t total = std::max(send_bytes, recv_bytes);
  for (int64_t off = 0; off < total; off += kChunk) {
    const int s = int(std::max<int64_t>(0, std::min(kChunk, send_bytes - off)));
    const int r = int(std::max<int64_t>(0, std::min(kChunk, recv_bytes - off)));
    MATEX_COLL(MPI_Sendrecv(s ? send + off : nullptr, s, MPI_BYTE, partner, kTag,
                            r ? recv + off : nullptr, r, MPI_BYTE, partner, kTag, comm,
                            MPI_STATUS_IGNORE),
               "MPI_Sendrecv (sparse allreduce)");
  }
  return Status::Ok();
}

// Header of a stream on the wire: rows (-1: dense), and whether any rank
// seen so far had bad input (then no payload follows).
struct Header {
  int64_t n;
  int64_t bad;
};

// Exchange streams with `partner`; *mine becomes the merged stream.
Status Exchange(MPI_Comm comm, int partner, const Layout& L, Stream* mine, bool* bad,
                int64_t* sent) {
  Header out{mine->dense ? -1 : mine->n, *bad ? 1 : 0}, in{0, 0};
  MATEX_COLL(MPI_Sendrecv(&out, 2, MPI_INT64_T, partner, kTag, &in, 2, MPI_INT64_T, partner,
                          kTag, comm, MPI_STATUS_IGNORE),
             "MPI_Sendrecv (sparse allreduce header)");
  *sent += int64_t(sizeof(Header));
  if (*bad || in.bad) {
    *bad = true;
    return Status::Ok();
  }
  Stream theirs;
  theirs.dense = in.n < 0;
  theirs.n = theirs.dense ? L.rows : in.n;
  theirs.buf.resize(size_t(L.Bytes(theirs.dense, theirs.n)));
  Status s = SendRecvBytes(comm, partner, mine->buf.data(), int64_t(mine->buf.size()),
                           theirs.buf.data(), int64_t(theirs.buf.size()));
  if (!s.ok()) return s;
  *sent += int64_t(mine->buf.size());
  *mine = L.Merge(*mine, theirs);
  return Status::Ok();
}

Status SendStream(MPI_Comm comm, int to, const Stream& s, bool bad, int64_t* sent) {
  Header h{s.dense ? -1 : s.n, bad ? 1 : 0};
  MATEX_COLL(MPI_Send(&h, 2, MPI_INT64_T, to, kTag, comm), "MPI_Send (sparse allreduce)");
  *sent += int64_t(sizeof(Header));
  if (bad) return Status::Ok();
  for (int64_t off = 0; off < int64_t(s.buf.size()); off += kChunk) {
    const int n = int(std::min<int64_t>(kChunk, int64_t(s.buf.size()) - off));
    MATEX_COLL(MPI_Send(s.buf.data() + off, n, MPI_BYTE, to, kTag, comm),
               "MPI_Send (sparse allreduce)");
  }
  *sent += int64_t(s.buf.size());
  return Status::Ok();
}

Status RecvStream(MPI_Comm comm, int from, const Layout& L, Stream* s, bool* bad) {
  Header h{0, 0};
  MATEX_COLL(MPI_Recv(&h, 2, MPI_INT64_T, from, kTag, comm, MPI_STATUS_IGNORE),
             "MPI_Recv (sparse allreduce)");
  if (h.bad) {
    *bad = true;
    return Status::Ok();
  }
  s->dense = h.n < 0;
  s->n = s->dense ? L.rows : h.n;
  s->buf.resize(size_t(L.Bytes(s->dense, s->n)));
  for (int64_t off = 0; off < int64_t(s->buf.size()); off += kChunk) {
    const int n = int(std::min<int64_t>(kChunk, int64_t(s->buf.size()) - off));
    MATEX_COLL(MPI_Recv(s->buf.data() + off, n, MPI_BYTE, from, kTag, comm, MPI_STATUS_IGNORE),
               "MPI_Recv (sparse allreduce)");
  }
  return Status::Ok();
}

Status Run(MPI_Comm comm, const int64_t* indices, int64_t nnz, const void* values,
           const Layout& L, const SparseAllocate& allocate, int64_t* sent) {
  int rank = 0, size = 1;
  MATEX_MPI(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  MATEX_MPI(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  Stream mine;
  std::string why;
  bool bad = !LocalStream(indices, nnz, values, L, &mine, &why);
  const bool my_fault = bad;
  int p2 = 1;
  while (p2 * 2 <= size) p2 *= 2;
  const int extra = size - p2;
  Status s;
  if (rank >= p2) {   // fold in: hand my stream to rank - p2, get the result back last
    s = SendStream(comm, rank - p2, mine, bad, sent);
    if (!s.ok()) return s;
    s = RecvStream(comm, rank - p2, L, &mine, &bad);
    if (!s.ok()) return s;
  } else {
    if (rank < extra) {
      Stream theirs;
      bool their_bad = false;
      s = RecvStream(comm, rank + p2, L, &theirs, &their_bad);
      if (!s.ok()) return s;
      if (their_bad) bad = true;
      if (!bad) mine = L.Merge(mine, theirs);
    }
    for (int mask = 1; mask < p2; mask <<= 1) {
      s = Exchange(comm, rank ^ mask, L, &mine, &bad, sent);
      if (!s.ok()) return s;
    }
    if (rank < extra) {
      s = SendStream(comm, rank + p2, mine, bad, sent);
      if (!s.ok()) return s;
    }
  }
  if (bad) {
    return Status::Invalid(my_fault ? "sparse allreduce: " + why
                                    : std::string("sparse allreduce: an index was out of "
                                                  "range [0, ") + std::to_string(L.rows) +
                                          ") on another rank");
  }
  SparseBuffers out = allocate(mine.n, mine.dense);
  if ((mine.n > 0 && out.values == nullptr) || (mine.n > 0 && out.indices == nullptr)) {
    return Status::Invalid("sparse allreduce: output allocation failed");
  }
  if (mine.dense) {
    for (int64_t i = 0; i < mine.n; ++i) out.indices[i] = i;
    if (!mine.buf.empty()) std::memcpy(out.values, mine.buf.data(), mine.buf.size());
  } else if (mine.n) {
    std::memcpy(out.indices, L.Index(mine), size_t(mine.n) * 8);
    std::memcpy(out.values, L.Row(mine, 0), size_t(mine.n * L.row_bytes));
  }
  return Status::Ok();
}

}  // namespace

Status SparseAllreduce(const int64_t* indices, int64_t nnz, const void* values,
                       const std::vector<int64_t>& row_shape, int64_t dense_rows,
                       DataType dtype, int64_t switch_rows, const SparseAllocate& allocate,
                       int64_t* bytes_sent, int slot) {
  *bytes_sent = 0;
  MPI_Comm comm;
  Status s = internal::CurrentComm(&comm, slot);
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> serial(internal::CollectiveMutex(slot));
  // What must agree: dtype, the dense shape (first dim and row shape) and the
  // switch point; not the number of rows each rank brings.
  std::vector<int64_t> dense_shape{dense_rows};
  dense_shape.insert(dense_shape.end(), row_shape.begin(), row_shape.end());
  Agreement check(comm, Kind::kSparseAllreduce, dtype, switch_rows, {&dense_shape});
  return check.Done([&] {
    Status st = check.Agree();
    if (!st.ok()) return st;
    // Agreed values: every rank fails alike on these.
    if (dense_rows < 0) return Status::Invalid("sparse allreduce: negative dense rows");
    Layout L;
    L.rows = dense_rows;
    L.row_elems = 1;
    for (int64_t d : row_shape) {
      if (d < 0) return Status::Invalid("sparse allreduce: negative row dimension");
      L.row_elems *= d;
    }
    L.row_bytes = L.row_elems * int64_t(DataTypeSize(dtype));
    L.switch_rows = std::max<int64_t>(switch_rows, 0);
    L.add = Adder(dtype);
    st = Run(comm, indices, nnz, values, L, allocate, bytes_sent);
    check.SetBytes(*bytes_sent);   // what was sent, not the dense size
    return st;
  }());
}

}  // namespace matex
