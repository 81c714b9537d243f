// pybind11 module `_matex_core`: the bridge for what is not a TensorFlow op.
// It hands mpi4py's communicator to the core and exposes the core's
// collectives on NumPy arrays, so they can be tested without TensorFlow.
// MPI calls run with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "matex_core.h"

namespace py = pybind11;

namespace {

py::object g_mpi_error;       // _matex_core.MPIError(message, error_class)
py::object g_mismatch_error;  // _matex_core.MismatchError(message)

void Raise(const matex::Status& s) {
  if (s.kind == matex::Status::Kind::kMpiError) {
    PyErr_SetObject(g_mpi_error.ptr(),
                    py::make_tuple(s.message, s.mpi_error_class).ptr());
  } else if (s.kind == matex::Status::Kind::kMismatch) {
    PyErr_SetString(g_mismatch_error.ptr(), s.message.c_str());
  } else {
    PyErr_SetString(PyExc_RuntimeError, s.message.c_str());
  }
  throw py::error_already_set();
}

matex::DataType ParseDtype(const std::string& name) {
  static const char* names[] = {"float16", "bfloat16", "float32", "float64",
                                "int32",   "int64",    "uint8",   "int8",
                                "uint16",  "int16",    "bool"};
  for (int i = 0; i < 11; ++i) {
    if (name == names[i]) return static_cast<matex::DataType>(i);
  }
  throw py::type_error("MaTEx collectives do not support dtype " + name);
}

matex::ReduceOp ParseOp(const std::string& name) {
  if (name == "sum") return matex::ReduceOp::kSum;
  if (name == "average") return matex::ReduceOp::kAverage;
  if (name == "min") return matex::ReduceOp::kMin;
  if (name == "max") return matex::ReduceOp::kMax;
  if (name == "product") return matex::ReduceOp::kProduct;
  throw py::value_error("unknown reduce op '" + name +
                        "' (expected sum, average, min, max or product)");
}

matex::TensorRef Ref(const py::array& a) {
  if (!(a.flags() & py::array::c_style)) {
    throw py::value_error("array must be C-contiguous");
  }
  matex::TensorRef r;
  r.data = a.data();
  for (py::ssize_t i = 0; i < a.ndim(); ++i) r.shape.push_back(a.shape(i));
  return r;
}

// The Python caller's "file:line", recorded by the flight recorder as the
// collective's call site; built only while it records.
class PySite {
 public:
  PySite() {
    if (matex::FlightCapacity() == 0) return;
    PyFrameObject* frame = PyEval_GetFrame();   // borrowed
    if (frame == nullptr) return;
    PyCodeObject* code = PyFrame_GetCode(frame);   // new reference
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    text_ = std::string(file ? file : "?") + ":" + std::to_string(PyFrame_GetLineNumber(frame));
    Py_DECREF(code);
    if (PyErr_Occurred()) PyErr_Clear();
    matex::SetFlightSite(text_.c_str());
  }
  ~PySite() { matex::SetFlightSite(nullptr); }

 private:
  std::string text_;
};

// A communicator id as text (16 hex digits): JSON and JavaScript keep it whole.
std::string CommId(uint64_t id) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(id));
  return text;
}

py::dict EntryDict(const matex::FlightEntry& e) {
  py::dict d;
  d["seq"] = e.seq;
  d["comm"] = CommId(e.comm_id);
  d["comm_seq"] = e.comm_seq;
  d["kind"] = e.kind;
  d["dtype"] = matex::DataTypeName(static_cast<matex::DataType>(e.dtype));
  d["param"] = e.param;
  d["comm_rank"] = e.comm_rank;
  d["comm_size"] = e.comm_size;
  d["num_tensors"] = e.num_tensors;
  d["bytes"] = e.bytes;
  d["shape"] = std::vector<int64_t>(e.dims, e.dims + e.ndims);
  d["signature"] = e.signature;
  d["start"] = e.start;
  d["agreed"] = e.agreed;
  d["end"] = e.end;
  d["state"] = e.state;
  d["mpi_error_class"] = e.mpi_error_class;
  d["site"] = std::string(e.site);
  return d;
}

py::array EmptyLike(const py::array& a) {
  std::vector<py::ssize_t> shape(a.shape(), a.shape() + a.ndim());
  return py::array(a.dtype(), shape);
}

py::array Allreduce(const py::array& a, const std::string& dtype,
                    const std::string& op, int comm) {
  PySite site;
  matex::TensorRef in = Ref(a);
  py::array out = EmptyLike(a);
  void* dst = out.mutable_data();
  matex::Status s;
  {
    py::gil_scoped_release nogil;
    s = matex::Allreduce(in, dst, ParseDtype(dtype), ParseOp(op), comm);
  }
  if (!s.ok()) Raise(s);
  return out;
}

std::vector<py::array> FusedAllreduce(const std::vector<py::array>& arrays,
                                      const std::string& dtype,
                                      const std::string& op, int comm) {
  PySite site;
  std::vector<matex::TensorRef> ins;
  std::vector<py::array> outs;
  std::vector<void*> dsts;
  py::ssize_t total_bytes = 0;
  for (const auto& a : arrays) {
    ins.push_back(Ref(a));
    outs.push_back(EmptyLike(a));
    dsts.push_back(outs.back().mutable_data());
    total_bytes += a.nbytes();
  }
  std::vector<char> scratch(size_t(total_bytes) + 1);
  matex::Status s;
  {
    py::gil_scoped_release nogil;
    s = matex::FusedAllreduce(ins, dsts, ParseDtype(dtype), ParseOp(op),
                              scratch.data(), comm);
  }
  if (!s.ok()) Raise(s);
  return outs;
}

py::array Broadcast(const py::array& a, const std::string& dtype, int root, int comm) {
  PySite site;
  matex::TensorRef in = Ref(a);
  py::array out = EmptyLike(a);
  std::memcpy(out.mutable_data(), a.data(), size_t(a.nbytes()));
  void* dst = out.mutable_data();
  matex::Status s;
  {
    py::gil_scoped_release nogil;
    s = matex::Broadcast(dst, in.shape, ParseDtype(dtype), root, comm);
  }
  if (!s.ok()) Raise(s);
  return out;
}

py::array Allgather(const py::array& a, const std::string& dtype, int comm) {
  PySite site;
  matex::TensorRef in = Ref(a);
  std::vector<int64_t> first_dims;
  // The output is allocated inside the collective, after the sizes are known:
  // reacquire the GIL only for that.
  py::array out;
  auto allocate = [&](int64_t rows) -> void* {
    py::gil_scoped_acquire gil;
    std::vector<py::ssize_t> shape(a.shape(), a.shape() + a.ndim());
    shape[0] = rows;
    out = py::array(a.dtype(), shape);
    return out.mutable_data();
  };
  matex::Status s;
  {
    py::gil_scoped_release nogil;
    s = matex::Allgather(in, ParseDtype(dtype), allocate, &first_dims, comm);
  }
  if (!s.ok()) Raise(s);
  return out;
}

}  // namespace

PYBIND11_MODULE(_matex_core, m) {
  m.doc() = "MaTEx C++ core: communicator state and MPI collectives on NumPy arrays.";
  g_mpi_error = py::reinterpret_borrow<py::object>(
      PyErr_NewException("_matex_core.MPIError", PyExc_RuntimeError, nullptr));
  g_mismatch_error = py::reinterpret_borrow<py::object>(
      PyErr_NewException("_matex_core.MismatchError", PyExc_ValueError, nullptr));
  m.attr("MPIError") = g_mpi_error;
  m.attr("MismatchError") = g_mismatch_error;
  m.def("set_communicator", &matex::SetCommunicator, py::arg("handle"));
  m.def("get_communicator", &matex::GetCommunicator);
  m.def("set_communicator_slot", &matex::SetCommunicatorSlot, py::arg("slot"), py::arg("handle"));
  m.def("get_communicator_slot", &matex::GetCommunicatorSlot, py::arg("slot"));
  m.attr("MAX_COMM_SLOTS") = matex::kMaxCommSlots;
  m.def("set_agreement_check", &matex::SetAgreementCheck, py::arg("enabled"));
  m.def("agreement_check", &matex::AgreementCheck);
  m.def("collective_call_count", &matex::CollectiveCallCount);
  m.def("begin_graph_run", &matex::BeginGraphRun, py::arg("order"));
  m.def("end_graph_run", &matex::EndGraphRun);
  m.def("start_progress_thread", &matex::StartProgressThread, py::arg("interval_seconds"),
        py::call_guard<py::gil_scoped_release>());
  m.def("stop_progress_thread", &matex::StopProgressThread,
        py::call_guard<py::gil_scoped_release>());
  m.def("progress_thread_running", &matex::ProgressThreadRunning);
  m.def("set_flight_capacity", &matex::SetFlightCapacity, py::arg("capacity"));
  m.def("flight_capacity", &matex::FlightCapacity);
  m.def("flight_sequence", &matex::FlightSequence);
  m.def("flight_pending_since", &matex::FlightPendingSince);
  m.def("install_flight_signal", &matex::InstallFlightSignal, py::arg("signum"));
  m.def("take_flight_signal", &matex::TakeFlightSignal);
  m.def("flight_entries", [] {
    std::vector<matex::FlightEntry> entries = matex::FlightEntries();
    py::list out;
    for (const auto& e : entries) out.append(EntryDict(e));
    return out;
  });
  m.def("flight_comms", [] {
    py::list out;
    for (const auto& c : matex::FlightComms()) {
      py::dict d;
      d["comm"] = CommId(c.id);
      d["members"] = c.members;
      d["seq"] = c.seq;
      d["pending_seq"] = c.pending_seq;
      d["pending_since"] = c.pending_since;
      d["current"] = c.current;
      d["slots"] = c.slots;
      out.append(d);
    }
    return out;
  });
  m.def("comm_info", [](int comm) {
    int rank = 0, size = 0;
    matex::Status s = matex::CommInfo(&rank, &size, comm);
    if (!s.ok()) Raise(s);
    return py::make_tuple(rank, size);
  }, py::arg("comm") = 0);
  m.def("allreduce", &Allreduce, py::arg("array"), py::arg("dtype"), py::arg("op"),
        py::arg("comm") = 0);
  m.def("fused_allreduce", &FusedAllreduce, py::arg("arrays"), py::arg("dtype"),
        py::arg("op"), py::arg("comm") = 0);
  m.def("broadcast", &Broadcast, py::arg("array"), py::arg("dtype"), py::arg("root"),
        py::arg("comm") = 0);
  m.def("allgather", &Allgather, py::arg("array"), py::arg("dtype"), py::arg("comm") = 0);
}
