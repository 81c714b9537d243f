// MatexMappedBatchDataset: a tf.data source of batches whose rows are
// gathered straight from the page cache (files memory-mapped read-only) into
// each batch's tensor, for matex.readers (readers/_gather.py). No MPI, no
// Python, no function call and no copy besides the gather itself per batch.
// One mapping per file is shared by every kernel that reads it (each epoch's
// iterator instantiates its own kernel).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/dataset.h"
#include "tensorflow/core/framework/model.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

// A file mapped read-only, unmapped when its last user lets go.
struct Mapping {
  const char* base = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (base != nullptr) munmap(const_cast<char*>(base), size);
  }
};

// Mappings in use, by file identity (device, inode, size, mtime): a file
// replaced or rewritten under the same path gets a mapping of its own.
using FileKey = std::tuple<dev_t, ino_t, off_t, int64_t, int64_t>;

absl::Status MapFile(const std::string& path, std::shared_ptr<const Mapping>* out) {
  static std::mutex lock;
  static std::map<FileKey, std::weak_ptr<const Mapping>> mappings;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError("MatexMappedBatchDataset: cannot open " + path + ": " +
                               std::strerror(errno));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    return absl::InternalError("MatexMappedBatchDataset: cannot stat " + path + ": " +
                               std::strerror(err));
  }
  FileKey key{st.st_dev, st.st_ino, st.st_size, static_cast<int64_t>(st.st_mtim.tv_sec),
              static_cast<int64_t>(st.st_mtim.tv_nsec)};
  std::lock_guard<std::mutex> guard(lock);
  auto found = mappings.find(key);
  if (found != mappings.end()) {
    *out = found->second.lock();
    if (*out) {
      close(fd);
      return absl::OkStatus();
    }
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<size_t>(st.st_size);
  if (mapping->size > 0) {
    void* base = mmap(nullptr, mapping->size, PROT_READ, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      int err = errno;
      close(fd);
      return absl::InternalError("MatexMappedBatchDataset: cannot map " + path + ": " +
                                 std::strerror(err));
    }
    mapping->base = static_cast<const char*>(base);
  }
  close(fd);
  for (auto it = mappings.begin(); it != mappings.end();) {   // forget released ones
    it = it->second.expired() ? mappings.erase(it) : std::next(it);
  }
  mappings[key] = mapping;
  *out = mapping;
  return absl::OkStatus();
}

REGISTER_OP("MatexMappedBatchDataset")
    .Input("rows: int64")
    .Input("batch_size: int64")
    .Output("handle: variant")
    .Attr("paths: list(string) >= 1")
    .Attr("offsets: list(int)")
    .Attr("strides: list(int)")
    .Attr("num_rows: list(int)")
    .Attr("output_types: list(type) >= 1")
    .Attr("output_shapes: list(shape) >= 1")
    .SetDoNotOptimize()      // a source dataset must not be constant-folded (as TF's own)
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Batches of `batch_size` of the rows `rows` (the last may be short) of one table per "
         "output: `num_rows` rows of the output's row shape and type, C-ordered, the first at "
         "byte `offsets` of the file `paths`, each `strides` bytes after the previous one. "
         "`output_shapes` are one batch's, leading dimension unknown.");

struct Table {
  std::shared_ptr<const Mapping> mapping;
  const char* first = nullptr;
  int64_t stride = 0, num_rows = 0, row_bytes = 0;
  TensorShape row_shape;
  tensorflow::DataType dtype;
};

class MappedBatchDataset : public tensorflow::data::DatasetBase {
 public:
  MappedBatchDataset(OpKernelContext* ctx, Tensor rows, int64_t batch, std::vector<Table> tables,
                     std::vector<std::string> paths, std::vector<int64_t> offsets,
                     tensorflow::DataTypeVector dtypes,
                     std::vector<tensorflow::PartialTensorShape> shapes)
      : DatasetBase(tensorflow::data::DatasetContext(ctx)), rows_(std::move(rows)),
        batch_(batch), tables_(std::move(tables)), paths_(std::move(paths)),
        offsets_(std::move(offsets)), dtypes_(std::move(dtypes)), shapes_(std::move(shapes)) {}

  std::unique_ptr<tensorflow::data::IteratorBase> MakeIteratorInternal(
      const std::string& prefix) const override {
    return std::make_unique<Iterator>(
        Iterator::Params{this, tensorflow::strings::StrCat(prefix, "::MatexMappedBatch")});
  }
  const tensorflow::DataTypeVector& output_dtypes() const override { return dtypes_; }
  const std::vector<tensorflow::PartialTensorShape>& output_shapes() const override {
    return shapes_;
  }
  std::string DebugString() const override { return "MatexMappedBatchDatasetOp::Dataset"; }
  int64_t CardinalityInternal(tensorflow::data::CardinalityOptions) const override {
    return (rows_.NumElements() + batch_ - 1) / batch_;
  }
  absl::Status InputDatasets(std::vector<const DatasetBase*>*) const override {
    return absl::OkStatus();
  }
  absl::Status CheckExternalState() const override { return absl::OkStatus(); }

 protected:
  absl::Status AsGraphDefInternal(tensorflow::data::SerializationContext* ctx,
                                  DatasetGraphDefBuilder* b,
                                  tensorflow::Node** output) const override {
    tensorflow::Node* rows = nullptr;
    tensorflow::Node* batch = nullptr;
    TF_RETURN_IF_ERROR(b->AddTensor(rows_, &rows));
    TF_RETURN_IF_ERROR(b->AddScalar(batch_, &batch));
    std::vector<int64_t> strides, num_rows;
    for (const Table& t : tables_) {
      strides.push_back(t.stride);
      num_rows.push_back(t.num_rows);
    }
    tensorflow::AttrValue paths, offsets, stride_list, rows_list;
    b->BuildAttrValue(paths_, &paths);
    b->BuildAttrValue(offsets_, &offsets);
    b->BuildAttrValue(strides, &stride_list);
    b->BuildAttrValue(num_rows, &rows_list);
    return b->AddDataset(this, {rows, batch},
                         {{"paths", paths}, {"offsets", offsets}, {"strides", stride_list},
                          {"num_rows", rows_list}},
                         output);
  }

 private:
  class Iterator : public tensorflow::data::DatasetIterator<MappedBatchDataset> {
   public:
    explicit Iterator(const Params& params)
        : tensorflow::data::DatasetIterator<MappedBatchDataset>(params) {}

    absl::Status GetNextInternal(tensorflow::data::IteratorContext* ctx,
                                 std::vector<Tensor>* out, bool* end_of_sequence) override {
      const MappedBatchDataset& d = *dataset();
      const int64_t total = d.rows_.NumElements();
      int64_t start;
      {
        tensorflow::mutex_lock l(mu_);
        if (next_ >= total) {
          *end_of_sequence = true;
          return absl::OkStatus();
        }
        start = next_;
        next_ = std::min(total, next_ + d.batch_);
      }
      const int64_t n = std::min(total - start, d.batch_);
      const int64_t* rows = d.rows_.flat<int64_t>().data() + start;
      out->reserve(d.tables_.size());
      for (const Table& t : d.tables_) {
        TensorShape shape({n});
        shape.AppendShape(t.row_shape);
        Tensor batch(ctx->allocator({}), t.dtype, shape);
        char* dst = static_cast<char*>(batch.data());
        const size_t bytes = static_cast<size_t>(t.row_bytes);
        for (int64_t i = 0; i < n; ++i, dst += bytes) {
          std::memcpy(dst, t.first + rows[i] * t.stride, bytes);
        }
        out->push_back(std::move(batch));
      }
      *end_of_sequence = false;
      return absl::OkStatus();
    }

   protected:
    std::shared_ptr<tensorflow::data::model::Node> CreateNode(
        tensorflow::data::IteratorContext*,
        tensorflow::data::model::Node::Args args) const override {
      return tensorflow::data::model::MakeSourceNode(std::move(args));
    }
    absl::Status SaveInternal(tensorflow::data::SerializationContext*,
                              tensorflow::data::IteratorStateWriter* writer) override {
      tensorflow::mutex_lock l(mu_);
      return writer->WriteScalar(prefix(), "next", next_);
    }
    absl::Status RestoreInternal(tensorflow::data::IteratorContext*,
                                 tensorflow::data::IteratorStateReader* reader) override {
      tensorflow::mutex_lock l(mu_);
      return reader->ReadScalar(prefix(), "next", &next_);
    }

   private:
    tensorflow::mutex mu_;
    int64_t next_ TF_GUARDED_BY(mu_) = 0;
  };

  const Tensor rows_;
  const int64_t batch_;
  const std::vector<Table> tables_;
  const std::vector<std::string> paths_;
  const std::vector<int64_t> offsets_;
  const tensorflow::DataTypeVector dtypes_;
  const std::vector<tensorflow::PartialTensorShape> shapes_;
};

class MappedBatchDatasetOp : public tensorflow::data::DatasetOpKernel {
 public:
  explicit MappedBatchDatasetOp(OpKernelConstruction* c) : DatasetOpKernel(c) {
    std::vector<int64_t> strides, num_rows;
    OP_REQUIRES_OK(c, c->GetAttr("paths", &paths_));
    OP_REQUIRES_OK(c, c->GetAttr("offsets", &offsets_));
    OP_REQUIRES_OK(c, c->GetAttr("strides", &strides));
    OP_REQUIRES_OK(c, c->GetAttr("num_rows", &num_rows));
    OP_REQUIRES_OK(c, c->GetAttr("output_types", &dtypes_));
    OP_REQUIRES_OK(c, c->GetAttr("output_shapes", &shapes_));
    const size_t n = paths_.size();
    OP_REQUIRES(c, offsets_.size() == n && strides.size() == n && num_rows.size() == n &&
                       dtypes_.size() == n && shapes_.size() == n,
                absl::InvalidArgumentError("MatexMappedBatchDataset: one path, offset, stride, "
                                           "row count, type and shape per output"));
    for (size_t k = 0; k < n; ++k) {
      Table t;
      t.dtype = dtypes_[k];
      t.stride = strides[k];
      t.num_rows = num_rows[k];
      bool known = shapes_[k].dims() >= 1;
      for (int i = 1; known && i < shapes_[k].dims(); ++i) {
        known = shapes_[k].dim_size(i) >= 0;
        if (known) t.row_shape.AddDim(shapes_[k].dim_size(i));
      }
      OP_REQUIRES(c, known && t.stride >= 1 &&
                         offsets_[k] >= 0 && t.num_rows >= 0,
                  absl::InvalidArgumentError("MatexMappedBatchDataset: output " +
                                             std::to_string(k) + " needs a known row shape, "
                                             "a positive stride, no negative offset or count"));
      t.row_bytes = t.row_shape.num_elements() * tensorflow::DataTypeSize(t.dtype);
      OP_REQUIRES(c, t.row_bytes <= t.stride,
                  absl::InvalidArgumentError("MatexMappedBatchDataset: rows overlap"));
      OP_REQUIRES_OK(c, MapFile(paths_[k], &t.mapping));
      const uint64_t end = t.num_rows == 0 ? 0
                                           : uint64_t(offsets_[k]) +
                                                 uint64_t(t.num_rows - 1) * t.stride + t.row_bytes;
      OP_REQUIRES(c, end <= t.mapping->size,
                  absl::InvalidArgumentError(
                      "MatexMappedBatchDataset: " + paths_[k] + " has " +
                      std::to_string(t.mapping->size) + " bytes, the table ends at byte " +
                      std::to_string(end)));
      t.first = t.mapping->base + offsets_[k];
      tables_.push_back(std::move(t));
    }
  }

  void MakeDataset(OpKernelContext* ctx, tensorflow::data::DatasetBase** output) override {
    const Tensor& rows = ctx->input(0);
    const Tensor& batch = ctx->input(1);
    OP_REQUIRES(ctx, rows.dims() == 1 && tensorflow::TensorShapeUtils::IsScalar(batch.shape()),
                absl::InvalidArgumentError(
                    "MatexMappedBatchDataset: rows must be a vector, batch_size a scalar"));
    const int64_t size = batch.scalar<int64_t>()();
    OP_REQUIRES(ctx, size >= 1,
                absl::InvalidArgumentError("MatexMappedBatchDataset: batch_size must be >= 1"));
    const auto r = rows.flat<int64_t>();
    for (const Table& t : tables_) {       // every row checked once, not per batch
      for (int64_t i = 0; i < r.size(); ++i) {
        OP_REQUIRES(ctx, r(i) >= 0 && r(i) < t.num_rows,
                    absl::InvalidArgumentError(
                        "MatexMappedBatchDataset: row " + std::to_string(r(i)) +
                        " is outside the table's " + std::to_string(t.num_rows) + " rows"));
      }
    }
    *output = new MappedBatchDataset(ctx, rows, size, tables_, paths_, offsets_, dtypes_,
                                     shapes_);
  }

 private:
  std::vector<Table> tables_;
  std::vector<std::string> paths_;
  std::vector<int64_t> offsets_;
  tensorflow::DataTypeVector dtypes_;
  std::vector<tensorflow::PartialTensorShape> shapes_;
};

REGISTER_KERNEL_BUILDER(Name("MatexMappedBatchDataset").Device(tensorflow::DEVICE_CPU),
                        MappedBatchDatasetOp);

}  // namespace
