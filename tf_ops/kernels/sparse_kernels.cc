// MatexSparseAllreduce: the op and its CPU kernel over the core's
// SparseAllreduce (tf_ops/core/sparse.h). The number of result rows is known
// only after the exchange, so the outputs are allocated then. Gradient and
// policy (the switch point, averaging, IndexedSlices) are in matex/_sparse.py.
#include "common.h"
#include "sparse.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using namespace matex_kernels;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("MatexSparseAllreduce")
    .Input("indices: int64")
    .Input("values: T")
    .Input("dense_rows: int64")
    .Input("switch_rows: int64")
    .Output("out_indices: int64")
    .Output("out_values: T")
    .Output("is_dense: bool")
    .Output("bytes_sent: int64")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("comm: int = 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle values, rest, out;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(1), 1, &values));
      TF_RETURN_IF_ERROR(c->Subshape(values, 1, &rest));
      TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(InferenceContext::kUnknownDim), rest, &out));
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(1, out);
      c->set_output(2, c->Scalar());
      c->set_output(3, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Sum over ranks of (index, row) pairs: sorted unique indices and their summed rows, "
         "or every row (is_dense) once the merged stream reached switch_rows rows.");

class SparseAllreduceOp : public OpKernel {
 public:
  explicit SparseAllreduceOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
  }

  void Compute(OpKernelContext* ctx) override { OP_REQUIRES_OK(ctx, Run(ctx)); }

  // The collective; an error is returned (Gated runs it asynchronously).
  absl::Status Run(OpKernelContext* ctx) {
    SiteScope site(*this);
    const Tensor& indices = ctx->input(0);
    const Tensor& values = ctx->input(1);
    if (indices.dims() != 1) {
      return absl::InvalidArgumentError("sparse allreduce: indices must be a vector");
    }
    if (!(values.dims() >= 1 && values.dim_size(0) == indices.dim_size(0))) {
      return absl::InvalidArgumentError(
          "sparse allreduce: values must have one row per index (values " +
          values.shape().DebugString() + ", indices " + indices.shape().DebugString() + ")");
    }
    matex::DataType dtype = matex::DataType::kFloat32;
    TF_RETURN_IF_ERROR(CoreType(values.dtype(), &dtype));
    const int64_t dense_rows = ctx->input(2).scalar<int64_t>()();
    const int64_t switch_rows = ctx->input(3).scalar<int64_t>()();
    std::vector<int64_t> row_shape;
    for (int i = 1; i < values.dims(); ++i) row_shape.push_back(values.dim_size(i));
    absl::Status alloc_status;
    bool dense = false;
    auto allocate = [&](int64_t rows, bool is_dense) -> matex::SparseBuffers {
      dense = is_dense;
      matex::SparseBuffers b;
      Tensor* out = nullptr;
      alloc_status = ctx->allocate_output(0, TensorShape({rows}), &out);
      if (!alloc_status.ok()) return b;
      b.indices = out->flat<int64_t>().data();
      TensorShape shape = values.shape();
      shape.set_dim(0, rows);
      alloc_status = ctx->allocate_output(1, shape, &out);
      if (!alloc_status.ok()) return matex::SparseBuffers();
      HugePagesFor(*out);
      b.values = const_cast<char*>(out->tensor_data().data());
      return b;
    };
    int64_t sent = 0;
    matex::Status s = matex::SparseAllreduce(
        indices.flat<int64_t>().data(), indices.dim_size(0), values.tensor_data().data(),
        row_shape, dense_rows, dtype, switch_rows, allocate, &sent, comm_);
    TF_RETURN_IF_ERROR(alloc_status);
    // Bad input (an index out of range on some rank) is the caller's error.
    if (s.kind == matex::Status::Kind::kInvalid) {
      return absl::InvalidArgumentError("matex sparse allreduce: " + s.message);
    }
    TF_RETURN_IF_ERROR(ToTf(s, "matex sparse allreduce"));
    Tensor* t = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(2, TensorShape({}), &t));
    t->scalar<bool>()() = dense;
    TF_RETURN_IF_ERROR(ctx->allocate_output(3, TensorShape({}), &t));
    t->scalar<int64_t>()() = sent;
    return absl::OkStatus();
  }

 private:
  int comm_ = 0;
};

MATEX_REGISTER_GATED(Name("MatexSparseAllreduce").Device(tensorflow::DEVICE_CPU),
                     SparseAllreduceOp);

}  // namespace
