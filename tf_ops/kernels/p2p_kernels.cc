// The point-to-point ops (MatexSend, MatexRecv, MatexSendRecv): registration
// and CPU kernels over the core's p2p.h. Gradients are registered in Python
// (matex/parallel/_p2p.py). Every op is stateful, so TensorFlow never folds,
// prunes or reorders one, and tf.function runs them in program order.
//
// Errors as for the collectives (see kernels.cc): a failed MPI call is
// INTERNAL with the MPI error class as payload; a sender and a receiver that
// disagree on dtype or shape both get INVALID_ARGUMENT ("matex.mismatch").
#include "../core/p2p.h"
#include "common.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

#define MATEX_P2P_DTYPES "{half, bfloat16, float, double, int32, int64}"

REGISTER_OP("MatexSend")
    .Input("tensor: T")
    .Output("token: T")
    .Attr("T: " MATEX_P2P_DTYPES)
    .Attr("dest: int")
    .Attr("tag: int = 0")
    .Attr("comm: int = 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Sends `tensor` to rank `dest`; returns a zero scalar (the token backprop "
         "attaches to: its gradient receives the gradient from `dest`).");

// The output's shape is the value of input 1 (the shape to receive).
static absl::Status ShapeFromInput1(InferenceContext* c) {
  ShapeHandle out;
  TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(1, &out));
  c->set_output(0, out);
  return absl::OkStatus();
}

REGISTER_OP("MatexRecv")
    .Input("token: T")
    .Input("shape: int64")
    .Output("output: T")
    .Attr("T: " MATEX_P2P_DTYPES)
    .Attr("source: int")
    .Attr("tag: int = 0")
    .Attr("comm: int = 0")
    .SetIsStateful()
    .SetShapeFn(ShapeFromInput1)
    .Doc("Receives a tensor of `shape` from rank `source`. `token` (a scalar) is "
         "not read: it gives backprop a path to this op.");

REGISTER_OP("MatexSendRecv")
    .Input("tensor: T")
    .Input("recv_shape: int64")
    .Output("output: R")
    .Attr("T: " MATEX_P2P_DTYPES)
    .Attr("R: " MATEX_P2P_DTYPES)
    .Attr("dest: int")
    .Attr("source: int")
    .Attr("tag: int = 0")
    .Attr("comm: int = 0")
    .SetIsStateful()
    .SetShapeFn(ShapeFromInput1)
    .Doc("Sends `tensor` to `dest` and receives a tensor of `recv_shape` from "
         "`source`, overlapped.");

namespace {

using namespace matex_kernels;

absl::Status ShapeFrom(const Tensor& t, TensorShape* shape, std::vector<int64_t>* dims) {
  if (t.dims() != 1) {
    return absl::InvalidArgumentError("matex recv: the shape must be a vector, got rank " +
                                      std::to_string(t.dims()));
  }
  auto v = t.vec<int64_t>();
  for (int64_t i = 0; i < v.size(); ++i) {
    if (v(i) < 0) {
      return absl::InvalidArgumentError("matex recv: negative dimension in the shape");
    }
    dims->push_back(v(i));
  }
  return TensorShape::BuildTensorShape(*dims, shape);
}

class SendOp : public OpKernel {
 public:
  explicit SendOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("dest", &dest_));
    OP_REQUIRES_OK(c, c->GetAttr("tag", &tag_));
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
  }
  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, Run(ctx)); }

  // The collective; an error is returned (Gated runs it asynchronously).
  absl::Status Run(OpKernelContext* ctx) {
    SiteScope site(*this);
    const Tensor& in = ctx->input(0);
    matex::DataType dtype;
    TF_RETURN_IF_ERROR(CoreType(in.dtype(), &dtype));
    TF_RETURN_IF_ERROR(ToTf(matex::Send(Ref(in), dtype, dest_, tag_, comm_), "matex send"));
    Tensor* token = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({}), &token));
    std::memset(const_cast<char*>(token->tensor_data().data()), 0, token->tensor_data().size());
    return absl::OkStatus();
  }

 private:
  int dest_, tag_, comm_;
};

class RecvOp : public OpKernel {
 public:
  explicit RecvOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("source", &source_));
    OP_REQUIRES_OK(c, c->GetAttr("tag", &tag_));
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
    OP_REQUIRES_OK(c, c->GetAttr("T", &dt_));
  }
  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, Run(ctx)); }

  // The collective; an error is returned (Gated runs it asynchronously).
  absl::Status Run(OpKernelContext* ctx) {
    SiteScope site(*this);
    TensorShape shape;
    std::vector<int64_t> dims;
    TF_RETURN_IF_ERROR(ShapeFrom(ctx->input(1), &shape, &dims));
    matex::DataType dtype;
    TF_RETURN_IF_ERROR(CoreType(dt_, &dtype));
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, shape, &out));
    HugePagesFor(*out);
    TF_RETURN_IF_ERROR(ToTf(matex::Recv(Mutable(Ref(*out)), dims, dtype, source_, tag_, comm_),
                            "matex recv"));
    return absl::OkStatus();
  }

 private:
  int source_, tag_, comm_;
  tensorflow::DataType dt_;
};

class SendRecvOp : public OpKernel {
 public:
  explicit SendRecvOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("dest", &dest_));
    OP_REQUIRES_OK(c, c->GetAttr("source", &source_));
    OP_REQUIRES_OK(c, c->GetAttr("tag", &tag_));
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
    OP_REQUIRES_OK(c, c->GetAttr("R", &recv_dt_));
  }
  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, Run(ctx)); }

  // The collective; an error is returned (Gated runs it asynchronously).
  absl::Status Run(OpKernelContext* ctx) {
    SiteScope site(*this);
    const Tensor& in = ctx->input(0);
    matex::DataType dtype, recv_dtype;
    TF_RETURN_IF_ERROR(CoreType(in.dtype(), &dtype));
    TF_RETURN_IF_ERROR(CoreType(recv_dt_, &recv_dtype));
    TensorShape shape;
    std::vector<int64_t> dims;
    TF_RETURN_IF_ERROR(ShapeFrom(ctx->input(1), &shape, &dims));
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, shape, &out));
    HugePagesFor(*out);
    TF_RETURN_IF_ERROR(ToTf(matex::SendRecv(Ref(in), dtype, dest_, Mutable(Ref(*out)), dims,
                                            recv_dtype, source_, tag_, comm_),
                            "matex sendrecv"));
    return absl::OkStatus();
  }

 private:
  int dest_, source_, tag_, comm_;
  tensorflow::DataType recv_dt_;
};

using tensorflow::DEVICE_CPU;
MATEX_REGISTER_GATED(Name("MatexSend").Device(DEVICE_CPU), SendOp);
MATEX_REGISTER_GATED(Name("MatexRecv").Device(DEVICE_CPU).HostMemory("shape"), RecvOp);
MATEX_REGISTER_GATED(Name("MatexSendRecv").Device(DEVICE_CPU).HostMemory("recv_shape"),
                     SendRecvOp);

}  // namespace
