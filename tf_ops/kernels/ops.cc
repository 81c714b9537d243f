// Registration of the MaTEx ops: names, attributes and shape functions.
// Kernels are in kernels.cc; gradients are registered in Python
// (matex/_collectives.py). Every op is stateful: TensorFlow must never fold,
// deduplicate or reorder a collective, and tf.function's automatic control
// dependencies then run them in program order (the same order on every rank).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

#define MATEX_DTYPES \
  "T: {half, bfloat16, float, double, int32, int64, uint8, int8, uint16, int16, bool}"
#define MATEX_REDUCE_OPS "reduce_op: {'sum', 'average', 'min', 'max', 'product'}"
// The communicator slot (matex_core.h): 0 is the data communicator.
#define MATEX_COMM "comm: int = 0"

REGISTER_OP("MatexAllreduce")
    .Input("tensor: T")
    .Output("output: T")
    .Attr(MATEX_DTYPES)
    .Attr(MATEX_REDUCE_OPS)
    .Attr(MATEX_COMM)
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape)
    .Doc("Reduces `tensor` over all ranks of the current MaTEx communicator.");

REGISTER_OP("MatexGroupedAllreduce")
    .Input("tensors: N * T")
    .Output("outputs: N * T")
    .Attr("N: int >= 1")
    .Attr(MATEX_DTYPES)
    .Attr(MATEX_REDUCE_OPS)
    .Attr(MATEX_COMM)
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    })
    .Doc("Reduces N tensors of one dtype with a single fused MPI call.");

REGISTER_OP("MatexBroadcast")
    .Input("tensor: T")
    .Output("output: T")
    .Attr(MATEX_DTYPES)
    .Attr("root: int = 0")
    .Attr(MATEX_COMM)
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape)
    .Doc("Returns rank `root`'s `tensor` on every rank.");

// Output 0 is input 0 with an unknown number of rows (allgather, alltoall,
// reducescatter: the row count depends on the other ranks).
static absl::Status RowsUnknown(InferenceContext* c) {
      ShapeHandle in, rest, out;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &in));
      TF_RETURN_IF_ERROR(c->Subshape(in, 1, &rest));
      TF_RETURN_IF_ERROR(
          c->Concatenate(c->Vector(InferenceContext::kUnknownDim), rest, &out));
      c->set_output(0, out);
      return absl::OkStatus();
}

REGISTER_OP("MatexAllgather")
    .Input("tensor: T")
    .Output("output: T")
    .Attr(MATEX_DTYPES)
    .Attr(MATEX_COMM)
    .SetIsStateful()
    .SetShapeFn(RowsUnknown)
    .Doc("Concatenates every rank's `tensor` along axis 0, in rank order.");

REGISTER_OP("MatexAlltoall")
    .Input("tensor: T")
    .Input("splits: int64")
    .Output("output: T")
    .Output("received_splits: int32")
    .Attr(MATEX_DTYPES)
    .Attr(MATEX_COMM)
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle splits;
      TF_RETURN_IF_ERROR(RowsUnknown(c));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &splits));
      c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc("Sends rows `splits[j]` of `tensor` (axis 0) to rank j (an empty `splits`: "
         "equal parts) and returns the rows received, in rank order, with their counts.");

REGISTER_OP("MatexReducescatter")
    .Input("tensor: T")
    .Output("output: T")
    .Attr(MATEX_DTYPES)
    .Attr(MATEX_REDUCE_OPS)
    .Attr(MATEX_COMM)
    .SetIsStateful()
    .SetShapeFn(RowsUnknown)
    .Doc("Reduces `tensor` over all ranks and returns this rank's part of axis 0 "
         "(the first n % size ranks get one row more).");

REGISTER_OP("MatexCommInfo")
    .Output("rank: int32")
    .Output("size: int32")
    .Attr(MATEX_COMM)
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Rank and size in the communicator in use when the op runs.");
