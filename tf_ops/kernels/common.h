// Helpers shared by the MaTEx kernels (kernels.cc and any later kernel
// file): TensorFlow tensors to core tensor references, core statuses to
// TensorFlow errors. Header-only; each function is inline.
#ifndef MATEX_KERNELS_COMMON_H_
#define MATEX_KERNELS_COMMON_H_

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "matex_core.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace matex_kernels {

using tensorflow::CancellationToken;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

// The node attribute naming the status code of a mismatch (an int, a
// TensorFlow error code). Absent: INVALID_ARGUMENT. matex.horovod sets
// FAILED_PRECONDITION, Horovod's code, on the ops it puts in a graph: a TF1
// Session drops the payload below (by which an eager caller tells a mismatch
// from other errors) but keeps the code.
constexpr char kMismatchCodeAttr[] = "_matex_mismatch_code";

inline absl::StatusCode MismatchCode(OpKernelConstruction* c) {
  int code = 0;
  if (c->HasAttr(kMismatchCodeAttr) && c->GetAttr(kMismatchCodeAttr, &code).ok() &&
      code > 0 && code <= int(absl::StatusCode::kUnauthenticated)) {
    return static_cast<absl::StatusCode>(code);
  }
  return absl::StatusCode::kInvalidArgument;
}

inline absl::Status ToTf(const matex::Status& s, const char* op,
                         absl::StatusCode mismatch = absl::StatusCode::kInvalidArgument) {
  if (s.ok()) return absl::OkStatus();
  std::string msg = std::string(op) + ": " + s.message;
  switch (s.kind) {
    case matex::Status::Kind::kMpiError: {
      absl::Status st = absl::InternalError(msg);
      const std::string error_class = std::to_string(s.mpi_error_class);
      st.SetPayload("matex.mpi_error_class",
                    absl::Cord(absl::string_view(error_class)));
      return st;
    }
    case matex::Status::Kind::kMismatch: {
      absl::Status st(mismatch, msg);
      st.SetPayload("matex.mismatch", absl::Cord(absl::string_view("1")));
      return st;
    }
    default:
      return absl::InternalError(msg);
  }
}

inline absl::Status CoreType(tensorflow::DataType dt, matex::DataType* out) {
  switch (dt) {
    case tensorflow::DT_HALF: *out = matex::DataType::kFloat16; break;
    case tensorflow::DT_BFLOAT16: *out = matex::DataType::kBFloat16; break;
    case tensorflow::DT_FLOAT: *out = matex::DataType::kFloat32; break;
    case tensorflow::DT_DOUBLE: *out = matex::DataType::kFloat64; break;
    case tensorflow::DT_INT32: *out = matex::DataType::kInt32; break;
    case tensorflow::DT_INT64: *out = matex::DataType::kInt64; break;
    case tensorflow::DT_UINT8: *out = matex::DataType::kUInt8; break;
    case tensorflow::DT_INT8: *out = matex::DataType::kInt8; break;
    case tensorflow::DT_UINT16: *out = matex::DataType::kUInt16; break;
    case tensorflow::DT_INT16: *out = matex::DataType::kInt16; break;
    case tensorflow::DT_BOOL: *out = matex::DataType::kBool; break;
    default:
      return absl::InvalidArgumentError("MaTEx collectives do not support " +
                                        tensorflow::DataTypeString(dt));
  }
  return absl::OkStatus();
}

inline absl::Status ParseReduceOp(OpKernelConstruction* c, matex::ReduceOp* op) {
  std::string name;
  TF_RETURN_IF_ERROR(c->GetAttr("reduce_op", &name));
  if (name == "sum") *op = matex::ReduceOp::kSum;
  else if (name == "average") *op = matex::ReduceOp::kAverage;
  else if (name == "min") *op = matex::ReduceOp::kMin;
  else if (name == "product") *op = matex::ReduceOp::kProduct;
  else *op = matex::ReduceOp::kMax;
  return absl::OkStatus();
}

inline matex::TensorRef Ref(const Tensor& t) {
  matex::TensorRef r;
  r.data = t.tensor_data().data();
  for (int i = 0; i < t.dims(); ++i) r.shape.push_back(t.dim_size(i));
  return r;
}

// Output 0 with input 0's shape and contents (the input buffer itself when
// TensorFlow lets us reuse it), for broadcast, which works in place.
inline absl::Status InPlaceOutput(OpKernelContext* ctx, matex::DataType* dtype,
                           matex::TensorRef* ref) {
  const Tensor& in = ctx->input(0);
  TF_RETURN_IF_ERROR(CoreType(in.dtype(), dtype));
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ctx->forward_input_or_allocate_output({0}, 0, in.shape(), &out));
  *ref = Ref(*out);
  if (ref->data != in.tensor_data().data()) {
    std::memcpy(const_cast<void*>(ref->data), in.tensor_data().data(),
                in.tensor_data().size());
  }
  return absl::OkStatus();
}

// Names this kernel's node as the flight recorder's call site for the
// collective it runs (the pointer lives as long as the kernel).
class SiteScope {
 public:
  explicit SiteScope(const OpKernel& k) { matex::SetFlightSite(k.name().c_str()); }
  ~SiteScope() { matex::SetFlightSite(nullptr); }
};

inline void* Mutable(const matex::TensorRef& ref) { return const_cast<void*>(ref.data); }

// Ask the kernel for transparent huge pages under a large output buffer, as
// NumPy does for its large arrays: MPI writes all of it on every call, and
// with 4 KB pages its copies were 4-7 % slower at 16-64 MB (TLB misses). A
// hint only: it changes no data, and a refusal is ignored.
inline void HugePagesFor(const Tensor& t) {
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  constexpr size_t kFrom = size_t(4) << 20;
  const size_t bytes = t.tensor_data().size();
  if (bytes < kFrom) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.tensor_data().data());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + bytes) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
}

// The node attribute a TF1 graph's MaTEx collective carries (its creation
// number, set by matex/_collectives.py). Such a kernel takes its turn in the
// graph-mode turnstile (turnstile.cc): while a scheduled Session.run is in
// progress it runs in the order the scheduler gave, on every rank the same.
// Without the attribute (eager, tf.function) the kernel is the plain one.
constexpr char kSeqAttr[] = "_matex_seq";

// `K`, asynchronous: a kernel whose turn has not come is queued (no executor
// thread waits for it), and a cancelled run withdraws it. `K::Run(ctx)` does
// the work and returns its error (OP_REQUIRES in an async kernel aborts).
template <class K>
class Gated : public tensorflow::AsyncOpKernel {
 public:
  explicit Gated(OpKernelConstruction* c) : AsyncOpKernel(c), inner_(c) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    using tensorflow::CancellationManager;
    CancellationManager* cm = ctx->cancellation_manager();
    CancellationToken token = CancellationManager::kInvalidToken;
    const std::string node = name();
    if (cm != nullptr) {   // registered before queuing: a queued kernel is always withdrawable
      token = cm->get_cancellation_token();
      if (!cm->RegisterCallback(token, [ctx, done, node]() {
            if (matex::Withdraw(node)) {
              ctx->SetStatus(absl::CancelledError(
                  "matex: run cancelled before collective " + node + " had its turn"));
              done();
            }
          })) {
        ctx->SetStatus(absl::CancelledError("matex: run cancelled before collective " + node));
        done();
        return;
      }
    }
    auto release = [cm, token]() {
      if (cm != nullptr) cm->TryDeregisterCallback(token);
    };
    auto turn = [this, ctx, done, release]() {
      release();
      ctx->SetStatus(inner_.Run(ctx));
      done();
    };
    switch (matex::TakeTurn(node, turn)) {
      case matex::Turn::kNow:
        release();
        ctx->SetStatus(inner_.Run(ctx));
        done();
        return;
      case matex::Turn::kUnscheduled:
        release();
        ctx->SetStatus(absl::FailedPreconditionError(
            "matex: collective " + node + " ran inside a Session.run whose collectives "
            "MaTEx's scheduler computed without it (a collective reached through "
            "control flow, a tf.function call, or Session.make_callable/partial_run "
            "while a scheduled run was in progress)"));
        done();
        return;
      case matex::Turn::kQueued:
        // cancelled between registering and queuing: the callback found nothing to withdraw
        if (cm != nullptr && cm->IsCancelled() && matex::Withdraw(node)) {
          release();
          ctx->SetStatus(absl::CancelledError("matex: run cancelled before collective " + node));
          done();
        }
        return;
    }
  }

 private:
  K inner_;
};

template <class K>
OpKernel* MaybeGated(OpKernelConstruction* c) {
  if (c->HasAttr(kSeqAttr)) return new Gated<K>(c);
  return new K(c);
}

// REGISTER_KERNEL_BUILDER for a collective that a TF1 graph may gate.
#define MATEX_REGISTER_GATED(builder, cls)                                       \
  static ::tensorflow::kernel_factory::OpKernelRegistrar matex_registrar_##cls( \
      ::tensorflow::register_kernel::builder.Build(), #cls, &MaybeGated<cls>)

}  // namespace matex_kernels

#endif  // MATEX_KERNELS_COMMON_H_
