// CPU kernels of the MaTEx ops: adapt TensorFlow tensors to the core and
// report core failures as TensorFlow errors. No policy here.
//
// A failed MPI call becomes INTERNAL carrying the MPI error class both as a
// status payload ("matex.mpi_error_class") and in the message. (Not
// UNAVAILABLE: TensorFlow rewrites that code, dropping payloads, when it comes
// from an op inside a nested function.) Ranks that disagree on a collective
// get INVALID_ARGUMENT with the payload "matex.mismatch"; other failures are
// INTERNAL without a payload.
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "matex_core.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

absl::Status ToTf(const matex::Status& s, const char* op) {
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
      absl::Status st = absl::InvalidArgumentError(msg);
      st.SetPayload("matex.mismatch", absl::Cord(absl::string_view("1")));
      return st;
    }
    default:
      return absl::InternalError(msg);
  }
}

absl::Status CoreType(tensorflow::DataType dt, matex::DataType* out) {
  switch (dt) {
    case tensorflow::DT_HALF: *out = matex::DataType::kFloat16; break;
    case tensorflow::DT_BFLOAT16: *out = matex::DataType::kBFloat16; break;
    case tensorflow::DT_FLOAT: *out = matex::DataType::kFloat32; break;
    case tensorflow::DT_DOUBLE: *out = matex::DataType::kFloat64; break;
    case tensorflow::DT_INT32: *out = matex::DataType::kInt32; break;
    case tensorflow::DT_INT64: *out = matex::DataType::kInt64; break;
    default:
      return absl::InvalidArgumentError("MaTEx collectives do not support " +
                                        tensorflow::DataTypeString(dt));
  }
  return absl::OkStatus();
}

absl::Status ParseReduceOp(OpKernelConstruction* c, matex::ReduceOp* op) {
  std::string name;
  TF_RETURN_IF_ERROR(c->GetAttr("reduce_op", &name));
  if (name == "sum") *op = matex::ReduceOp::kSum;
  else if (name == "average") *op = matex::ReduceOp::kAverage;
  else if (name == "min") *op = matex::ReduceOp::kMin;
  else *op = matex::ReduceOp::kMax;
  return absl::OkStatus();
}

matex::TensorRef Ref(const Tensor& t) {
  matex::TensorRef r;
  r.data = t.tensor_data().data();
  for (int i = 0; i < t.dims(); ++i) r.shape.push_back(t.dim_size(i));
  return r;
}

// Output 0 with input 0's shape and contents (the input buffer itself when
// TensorFlow lets us reuse it), for broadcast, which works in place.
absl::Status InPlaceOutput(OpKernelContext* ctx, matex::DataType* dtype,
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

void* Mutable(const matex::TensorRef& ref) { return const_cast<void*>(ref.data); }

// Ask the kernel for transparent huge pages under a large output buffer, as
// NumPy does for its large arrays: MPI writes all of it on every call, and
// with 4 KB pages its copies were 4-7 % slower at 16-64 MB (TLB misses). A
// hint only: it changes no data, and a refusal is ignored.
void HugePagesFor(const Tensor& t) {
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  constexpr size_t kFrom = size_t(4) << 20;
  const size_t bytes = t.tensor_data().size();
  if (bytes < kFrom) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.tensor_data().data());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + bytes) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
}

class AllreduceOp : public OpKernel {
 public:
  explicit AllreduceOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, ParseReduceOp(c, &op_));
  }
  void Compute(OpKernelContext* ctx) override {
    SiteScope site(*this);
    // MPI reduces from the input into the output: no copy, and in place when
    // TensorFlow lets the output reuse the input's buffer.
    const Tensor& in = ctx->input(0);
    matex::DataType dtype;
    OP_REQUIRES_OK(ctx, CoreType(in.dtype(), &dtype));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, in.shape(), &out));
    HugePagesFor(*out);
    OP_REQUIRES_OK(ctx, ToTf(matex::Allreduce(Ref(in), Mutable(Ref(*out)), dtype, op_),
                             "matex allreduce"));
  }

 private:
  matex::ReduceOp op_;
};

class GroupedAllreduceOp : public OpKernel {
 public:
  explicit GroupedAllreduceOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, ParseReduceOp(c, &op_));
  }
  void Compute(OpKernelContext* ctx) override {
    SiteScope site(*this);
    const int n = ctx->num_inputs();
    matex::DataType dtype;
    OP_REQUIRES_OK(ctx, CoreType(ctx->input(0).dtype(), &dtype));
    std::vector<matex::TensorRef> ins;
    std::vector<void*> outs;
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      const Tensor& in = ctx->input(i);
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, in.shape(), &out));
      ins.push_back(Ref(in));
      outs.push_back(const_cast<char*>(out->tensor_data().data()));
      total += in.NumElements();
    }
    Tensor scratch;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(ctx->input(0).dtype(),
                                           TensorShape({total}), &scratch));
    OP_REQUIRES_OK(
        ctx, ToTf(matex::FusedAllreduce(ins, outs, dtype, op_,
                                        const_cast<char*>(scratch.tensor_data().data())),
                  "matex fused allreduce"));
  }

 private:
  matex::ReduceOp op_;
};

class BroadcastOp : public OpKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root", &root_));
  }
  void Compute(OpKernelContext* ctx) override {
    SiteScope site(*this);
    matex::DataType dtype;
    matex::TensorRef ref;
    OP_REQUIRES_OK(ctx, InPlaceOutput(ctx, &dtype, &ref));
    OP_REQUIRES_OK(ctx, ToTf(matex::Broadcast(Mutable(ref), ref.shape, dtype, root_),
                             "matex broadcast"));
  }

 private:
  int root_;
};

class AllgatherOp : public OpKernel {
 public:
  explicit AllgatherOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    SiteScope site(*this);
    const Tensor& in = ctx->input(0);
    matex::DataType dtype;
    OP_REQUIRES_OK(ctx, CoreType(in.dtype(), &dtype));
    absl::Status alloc_status;
    auto allocate = [&](int64_t rows) -> void* {
      TensorShape shape = in.shape();
      shape.set_dim(0, rows);
      Tensor* out = nullptr;
      alloc_status = ctx->allocate_output(0, shape, &out);
      if (!alloc_status.ok()) return nullptr;
      HugePagesFor(*out);
      return const_cast<char*>(out->tensor_data().data());
    };
    std::vector<int64_t> first_dims;
    matex::Status s = matex::Allgather(Ref(in), dtype, allocate, &first_dims);
    OP_REQUIRES_OK(ctx, alloc_status);
    OP_REQUIRES_OK(ctx, ToTf(s, "matex allgather"));
  }
};

class CommInfoOp : public OpKernel {
 public:
  explicit CommInfoOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    int rank = 0, size = 0;
    OP_REQUIRES_OK(ctx, ToTf(matex::CommInfo(&rank, &size), "matex comm info"));
    Tensor* t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &t));
    t->scalar<int32_t>()() = rank;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &t));
    t->scalar<int32_t>()() = size;
  }
};

using tensorflow::DEVICE_CPU;
REGISTER_KERNEL_BUILDER(Name("MatexAllreduce").Device(DEVICE_CPU), AllreduceOp);
REGISTER_KERNEL_BUILDER(Name("MatexGroupedAllreduce").Device(DEVICE_CPU), GroupedAllreduceOp);
REGISTER_KERNEL_BUILDER(Name("MatexBroadcast").Device(DEVICE_CPU), BroadcastOp);
REGISTER_KERNEL_BUILDER(Name("MatexAllgather").Device(DEVICE_CPU), AllgatherOp);
REGISTER_KERNEL_BUILDER(Name("MatexCommInfo").Device(DEVICE_CPU), CommInfoOp);

}  // namespace
