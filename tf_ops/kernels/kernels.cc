// CPU kernels of the MaTEx ops: adapt TensorFlow tensors to the core and
// report core failures as TensorFlow errors. No policy here.
//
// A failed MPI call becomes INTERNAL carrying the MPI error class both as a
// status payload ("matex.mpi_error_class") and in the message. (Not
// UNAVAILABLE: TensorFlow rewrites that code, dropping payloads, when it comes
// from an op inside a nested function.) Ranks that disagree on a collective
// get INVALID_ARGUMENT with the payload "matex.mismatch" (or the code the
// node's "_matex_mismatch_code" attribute names: common.h); other failures
// are INTERNAL without a payload.
#include "common.h"

namespace {

using namespace matex_kernels;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

class AllreduceOp : public OpKernel {
 public:
  explicit AllreduceOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, ParseReduceOp(c, &op_));
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
    mismatch_ = MismatchCode(c);
  }
  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, Run(ctx)); }

  // The collective; an error is returned (Gated runs it asynchronously).
  absl::Status Run(OpKernelContext* ctx) {
    SiteScope site(*this);
    // MPI reduces from the input into the output: no copy, and in place when
    // TensorFlow lets the output reuse the input's buffer.
    const Tensor& in = ctx->input(0);
    matex::DataType dtype;
    TF_RETURN_IF_ERROR(CoreType(in.dtype(), &dtype));
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->forward_input_or_allocate_output({0}, 0, in.shape(), &out));
    HugePagesFor(*out);
    TF_RETURN_IF_ERROR(ToTf(matex::Allreduce(Ref(in), Mutable(Ref(*out)), dtype, op_, comm_),
                            "matex allreduce", mismatch_));
    return absl::OkStatus();
  }

 private:
  matex::ReduceOp op_;
  int comm_ = 0;
  absl::StatusCode mismatch_ = absl::StatusCode::kInvalidArgument;
};

class GroupedAllreduceOp : public OpKernel {
 public:
  explicit GroupedAllreduceOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, ParseReduceOp(c, &op_));
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
    mismatch_ = MismatchCode(c);
  }
  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, Run(ctx)); }

  // The collective; an error is returned (Gated runs it asynchronously).
  absl::Status Run(OpKernelContext* ctx) {
    SiteScope site(*this);
    const int n = ctx->num_inputs();
    matex::DataType dtype;
    TF_RETURN_IF_ERROR(CoreType(ctx->input(0).dtype(), &dtype));
    std::vector<matex::TensorRef> ins;
    std::vector<void*> outs;
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      const Tensor& in = ctx->input(i);
      Tensor* out = nullptr;
      TF_RETURN_IF_ERROR(ctx->allocate_output(i, in.shape(), &out));
      ins.push_back(Ref(in));
      outs.push_back(const_cast<char*>(out->tensor_data().data()));
      total += in.NumElements();
    }
    Tensor scratch;
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(ctx->input(0).dtype(), TensorShape({total}), &scratch));
    TF_RETURN_IF_ERROR(ToTf(matex::FusedAllreduce(ins, outs, dtype, op_,
                                                  const_cast<char*>(scratch.tensor_data().data()),
                                                  comm_),
                            "matex fused allreduce", mismatch_));
    return absl::OkStatus();
  }

 private:
  matex::ReduceOp op_;
  int comm_ = 0;
  absl::StatusCode mismatch_ = absl::StatusCode::kInvalidArgument;
};

class BroadcastOp : public OpKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root", &root_));
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
    mismatch_ = MismatchCode(c);
  }
  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, Run(ctx)); }

  // The collective; an error is returned (Gated runs it asynchronously).
  absl::Status Run(OpKernelContext* ctx) {
    SiteScope site(*this);
    matex::DataType dtype;
    matex::TensorRef ref;
    TF_RETURN_IF_ERROR(InPlaceOutput(ctx, &dtype, &ref));
    TF_RETURN_IF_ERROR(ToTf(matex::Broadcast(Mutable(ref), ref.shape, dtype, root_, comm_),
                            "matex broadcast", mismatch_));
    return absl::OkStatus();
  }

 private:
  int root_;
  int comm_ = 0;
  absl::StatusCode mismatch_ = absl::StatusCode::kInvalidArgument;
};

// An output buffer for the core to fill: TensorFlow leaves an empty tensor
// without one, and the core takes null for a failed allocation.
inline void* OutputData(const Tensor& t) {
  static char empty;
  void* p = const_cast<char*>(t.tensor_data().data());
  return p != nullptr ? p : &empty;
}

// The core's allocator for output 0: shaped like `in`, with `rows` rows. A
// failed allocation is kept in *status and returned to the core as null.
inline auto RowsLike(OpKernelContext* ctx, const Tensor& in, absl::Status* status) {
  return [ctx, &in, status](int64_t rows) -> void* {
    TensorShape shape = in.shape();
    shape.set_dim(0, rows);
    Tensor* out = nullptr;
    *status = ctx->allocate_output(0, shape, &out);
    if (!status->ok()) return nullptr;
    HugePagesFor(*out);
    return OutputData(*out);
  };
}

class AllgatherOp : public OpKernel {
 public:
  explicit AllgatherOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
    mismatch_ = MismatchCode(c);
  }
  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, Run(ctx)); }

  // The collective; an error is returned (Gated runs it asynchronously).
  absl::Status Run(OpKernelContext* ctx) {
    SiteScope site(*this);
    const Tensor& in = ctx->input(0);
    matex::DataType dtype;
    TF_RETURN_IF_ERROR(CoreType(in.dtype(), &dtype));
    absl::Status alloc_status;
    auto allocate = RowsLike(ctx, in, &alloc_status);
    std::vector<int64_t> first_dims;
    matex::Status s = matex::Allgather(Ref(in), dtype, allocate, &first_dims, comm_);
    TF_RETURN_IF_ERROR(alloc_status);
    TF_RETURN_IF_ERROR(ToTf(s, "matex allgather", mismatch_));
    return absl::OkStatus();
  }

 private:
  int comm_ = 0;
  absl::StatusCode mismatch_ = absl::StatusCode::kInvalidArgument;
};

// Splits the caller got wrong (on any rank) are an invalid argument, like a
// mismatch; other failures keep ToTf's mapping.
inline absl::Status InvalidIsArgument(const matex::Status& s, const char* op,
                                      absl::StatusCode mismatch) {
  if (s.kind == matex::Status::Kind::kInvalid) {
    return absl::InvalidArgumentError(std::string(op) + ": " + s.message);
  }
  return ToTf(s, op, mismatch);
}

class AlltoallOp : public OpKernel {
 public:
  explicit AlltoallOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
    mismatch_ = MismatchCode(c);
  }
  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, Run(ctx)); }

  // The collective; an error is returned (Gated runs it asynchronously).
  absl::Status Run(OpKernelContext* ctx) {
    SiteScope site(*this);
    const Tensor& in = ctx->input(0);
    const Tensor& splits_in = ctx->input(1);
    matex::DataType dtype;
    TF_RETURN_IF_ERROR(CoreType(in.dtype(), &dtype));
    if (splits_in.dims() != 1) {
      return absl::InvalidArgumentError("matex alltoall: splits must be a vector");
    }
    const auto flat = splits_in.flat<int64_t>();
    std::vector<int64_t> splits(flat.data(), flat.data() + flat.size());
    absl::Status alloc_status;
    auto allocate = RowsLike(ctx, in, &alloc_status);
    std::vector<int64_t> received;
    matex::Status s = matex::Alltoall(Ref(in), splits, dtype, allocate, &received, comm_);
    TF_RETURN_IF_ERROR(alloc_status);
    TF_RETURN_IF_ERROR(InvalidIsArgument(s, "matex alltoall", mismatch_));
    Tensor* t = nullptr;
    TF_RETURN_IF_ERROR(
        ctx->allocate_output(1, TensorShape({int64_t(received.size())}), &t));
    auto r = t->flat<int32_t>();
    for (size_t i = 0; i < received.size(); ++i) r(i) = int32_t(received[i]);
    return absl::OkStatus();
  }

 private:
  int comm_ = 0;
  absl::StatusCode mismatch_ = absl::StatusCode::kInvalidArgument;
};

class ReducescatterOp : public OpKernel {
 public:
  explicit ReducescatterOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, ParseReduceOp(c, &op_));
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
    mismatch_ = MismatchCode(c);
  }
  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, Run(ctx)); }

  // The collective; an error is returned (Gated runs it asynchronously).
  absl::Status Run(OpKernelContext* ctx) {
    SiteScope site(*this);
    const Tensor& in = ctx->input(0);
    matex::DataType dtype;
    TF_RETURN_IF_ERROR(CoreType(in.dtype(), &dtype));
    absl::Status alloc_status;
    auto allocate = RowsLike(ctx, in, &alloc_status);
    matex::Status s = matex::Reducescatter(Ref(in), dtype, op_, allocate, comm_);
    TF_RETURN_IF_ERROR(alloc_status);
    TF_RETURN_IF_ERROR(InvalidIsArgument(s, "matex reducescatter", mismatch_));
    return absl::OkStatus();
  }

 private:
  matex::ReduceOp op_;
  int comm_ = 0;
  absl::StatusCode mismatch_ = absl::StatusCode::kInvalidArgument;
};

class CommInfoOp : public OpKernel {
 public:
  explicit CommInfoOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
  }
  void Compute(OpKernelContext* ctx) override {
    int rank = 0, size = 0;
    OP_REQUIRES_OK(ctx, ToTf(matex::CommInfo(&rank, &size, comm_), "matex comm info"));
    Tensor* t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &t));
    t->scalar<int32_t>()() = rank;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &t));
    t->scalar<int32_t>()() = size;
  }

 private:
  int comm_ = 0;
};

using tensorflow::DEVICE_CPU;
MATEX_REGISTER_GATED(Name("MatexAllreduce").Device(DEVICE_CPU), AllreduceOp);
MATEX_REGISTER_GATED(Name("MatexGroupedAllreduce").Device(DEVICE_CPU), GroupedAllreduceOp);
MATEX_REGISTER_GATED(Name("MatexBroadcast").Device(DEVICE_CPU), BroadcastOp);
MATEX_REGISTER_GATED(Name("MatexAllgather").Device(DEVICE_CPU), AllgatherOp);
MATEX_REGISTER_GATED(Name("MatexAlltoall").Device(DEVICE_CPU), AlltoallOp);
MATEX_REGISTER_GATED(Name("MatexReducescatter").Device(DEVICE_CPU), ReducescatterOp);
REGISTER_KERNEL_BUILDER(Name("MatexCommInfo").Device(DEVICE_CPU), CommInfoOp);

}  // namespace
