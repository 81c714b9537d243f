// MatexIallreduceStart / MatexIallreduceWait / MatexIallreduceDrop /
// MatexIallreducePending: the ops over the core's non-blocking allreduce
// (tf_ops/core/nonblocking.h). Start posts and returns an int64 handle that
// a later step's Wait turns back into tensors; the handle crosses steps in a
// variable (policy in matex/_delayed.py). All stateful.
#include "common.h"
#include "nonblocking.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using namespace matex_kernels;
using tensorflow::PartialTensorShape;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("MatexIallreduceStart")
    .Input("tensors: N * T")
    .Output("handle: int64")
    .Attr("N: int >= 1")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("reduce_op: {'sum', 'average'}")
    .Attr("comm: int = 0")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Posts a non-blocking allreduce of N tensors of one dtype (one packed MPI "
         "request); returns the handle MatexIallreduceWait completes.");

REGISTER_OP("MatexIallreduceWait")
    .Input("handle: int64")
    .Output("outputs: N * T")
    .Output("valid: bool")
    .Attr("N: int >= 1")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("shapes: list(shape)")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      std::vector<PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("shapes", &shapes));
      for (size_t i = 0; i < shapes.size(); ++i) {
        ShapeHandle s;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &s));
        c->set_output(int(i), s);
      }
      c->set_output(int(shapes.size()), c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Completes the allreduce `handle` names and returns its tensors (valid=true); "
         "handle 0 means none is pending: zeros and valid=false.");

REGISTER_OP("MatexIallreduceDrop")
    .Output("dropped: int64")
    .Attr("complete: bool = true")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Forgets every pending non-blocking allreduce: completed first (complete=true: "
         "after a rank failure, their communicator revoked) or not (at exit).");

REGISTER_OP("MatexIallreducePending")
    .Output("pending: int64")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Number of posted non-blocking allreduces not yet completed or dropped.");

class IallreduceStartOp : public OpKernel {
 public:
  explicit IallreduceStartOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, ParseReduceOp(c, &op_));
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
  }

  void Compute(OpKernelContext* ctx) override {
    SiteScope site(*this);
    matex::DataType dtype;
    OP_REQUIRES_OK(ctx, CoreType(ctx->input(0).dtype(), &dtype));
    std::vector<matex::TensorRef> ins;
    for (int i = 0; i < ctx->num_inputs(); ++i) ins.push_back(Ref(ctx->input(i)));
    int64_t handle = 0;
    OP_REQUIRES_OK(ctx, ToTf(matex::IallreduceStart(ins, dtype, op_, comm_, &handle),
                             "matex non-blocking allreduce (start)"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = handle;
  }

 private:
  matex::ReduceOp op_;
  int comm_ = 0;
};

class IallreduceWaitOp : public OpKernel {
 public:
  explicit IallreduceWaitOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("shapes", &shapes_));
    OP_REQUIRES_OK(c, c->GetAttr("T", &dtype_));
    for (const auto& s : shapes_) {
      OP_REQUIRES(c, s.IsFullyDefined(),
                  absl::InvalidArgumentError("non-blocking allreduce: shape " +
                                             s.DebugString() + " is not fully defined"));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    SiteScope site(*this);
    const int64_t handle = ctx->input(0).scalar<int64_t>()();
    std::vector<void*> outs;
    std::vector<Tensor*> tensors;
    for (size_t i = 0; i < shapes_.size(); ++i) {
      TensorShape shape;
      shapes_[i].AsTensorShape(&shape);
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(int(i), shape, &out));
      outs.push_back(const_cast<char*>(out->tensor_data().data()));
      tensors.push_back(out);
    }
    Tensor* valid = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(int(shapes_.size()), TensorShape({}), &valid));
    valid->scalar<bool>()() = handle > 0;
    if (handle <= 0) {   // nothing pending: zeros
      for (Tensor* t : tensors) {
        std::memset(const_cast<char*>(t->tensor_data().data()), 0, t->tensor_data().size());
      }
      return;
    }
    matex::DataType want, have;
    OP_REQUIRES_OK(ctx, CoreType(dtype_, &want));
    std::vector<std::vector<int64_t>> started;
    OP_REQUIRES_OK(ctx, ToTf(matex::IallreduceShapes(handle, &have, &started),
                             "matex non-blocking allreduce (wait)"));
    bool same = have == want && started.size() == shapes_.size();
    for (size_t i = 0; same && i < started.size(); ++i) {
      same = started[i].size() == size_t(shapes_[i].dims());
      for (size_t d = 0; same && d < started[i].size(); ++d) {
        same = started[i][d] == shapes_[i].dim_size(int(d));
      }
    }
    if (!same) {
      // complete it anyway (its buffer is released), then refuse
      std::vector<void*> none;
      matex::IallreduceWait(handle, none);
      ctx->SetStatus(absl::InvalidArgumentError(
          "matex non-blocking allreduce (wait): handle " + std::to_string(handle) +
          " was started on other tensors (dtype or shapes differ from the wait's)"));
      return;
    }
    OP_REQUIRES_OK(ctx, ToTf(matex::IallreduceWait(handle, outs),
                             "matex non-blocking allreduce (wait)"));
  }

 private:
  std::vector<PartialTensorShape> shapes_;
  tensorflow::DataType dtype_;
};

class IallreduceDropOp : public OpKernel {
 public:
  explicit IallreduceDropOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("complete", &complete_));
  }
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() =
        complete_ ? matex::IallreduceDropAll() : matex::IallreduceForgetAll();
  }

 private:
  bool complete_ = true;
};

class IallreducePendingOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = matex::IallreducePending();
  }
};

REGISTER_KERNEL_BUILDER(Name("MatexIallreduceStart").Device(tensorflow::DEVICE_CPU),
                        IallreduceStartOp);
REGISTER_KERNEL_BUILDER(Name("MatexIallreduceWait").Device(tensorflow::DEVICE_CPU),
                        IallreduceWaitOp);
REGISTER_KERNEL_BUILDER(Name("MatexIallreduceDrop").Device(tensorflow::DEVICE_CPU),
                        IallreduceDropOp);
REGISTER_KERNEL_BUILDER(Name("MatexIallreducePending").Device(tensorflow::DEVICE_CPU),
                        IallreducePendingOp);

}  // namespace
