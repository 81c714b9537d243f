// MaTEx core: point-to-point transfers (send, receive, overlapped
// send-receive) between two ranks of one communicator slot.
//
// Like matex_core.h, this header includes neither mpi.h nor TensorFlow
// headers. Implementation: p2p.cc.
//
// Protocol. Every transfer is checked pairwise before any data moves (unless
// the agreement check is off): the sender and the receiver exchange a small
// header describing what each side is about to send or receive (dtype and
// shape); both compare the two descriptions, so a mismatch fails on BOTH ends
// with the same message and no data is posted. Only then are the data
// messages posted. All MPI calls are non-blocking (MPI_Isend/MPI_Irecv) and
// waited for without holding any lock: a receive blocked on its peer never
// stops another thread's send on the same communicator, nor a collective.
//
// Tags. The user tag (0 <= tag < kMaxP2PTag) selects one of several
// independent channels between the same pair; each transfer uses three MPI
// tags derived from it (header, reply, data). Messages between one pair with
// one tag are matched in the order they were issued (MPI's non-overtaking
// rule), so two threads must not issue transfers on the same pair, tag and
// slot concurrently (inside one tf.function the stateful ops run in program
// order, so this only concerns hand-written threads).
#ifndef MATEX_CORE_P2P_H_
#define MATEX_CORE_P2P_H_

#include <cstdint>
#include <vector>

#include "matex_core.h"

namespace matex {

constexpr int kMaxP2PTag = 8192;   // 3 MPI tags each; MPI guarantees tags up to 32767

// Send `in` to rank `dest` of communicator slot `slot`. Returns once the data
// is handed to MPI and the send completed (the buffer may be reused).
Status Send(const TensorRef& in, DataType dtype, int dest, int tag, int slot);

// Receive a tensor of `shape` and `dtype` from rank `source` into `out`.
Status Recv(void* out, const std::vector<int64_t>& shape, DataType dtype, int source,
            int tag, int slot);

// Send `in` to `dest` and receive a tensor of `recv_shape`/`recv_dtype` from
// `source`, both at once (no deadlock when every rank of a ring sends and
// receives together). A direction whose check fails moves no data; the other
// direction still completes, so its peer is not left waiting.
Status SendRecv(const TensorRef& in, DataType dtype, int dest, void* out,
                const std::vector<int64_t>& recv_shape, DataType recv_dtype, int source,
                int tag, int slot);

}  // namespace matex

#endif  // MATEX_CORE_P2P_H_
