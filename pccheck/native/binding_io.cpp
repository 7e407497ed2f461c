// Python binding of the injectable I/O layer (io.h): fault injection for the I/O-error tests and
// recording for the power-loss simulator (tests/_crashsim.py). Only converts types.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "io.h"

namespace py = pybind11;
using namespace pcc;

namespace {

const char* trace_op_name(uint32_t op) {
  switch (op) {
    case io::kTracePwrite: return "pwrite";
    case io::kTraceFdatasync: return "fdatasync";
    case io::kTraceMsync: return "msync";
    case io::kTraceFallocate: return "fallocate";
  }
  return "?";
}

}  // namespace

void bind_io(py::module_& m) {
  m.attr("OP_PWRITE") = uint32_t(io::kPwrite);
  m.attr("OP_FDATASYNC") = uint32_t(io::kFdatasync);
  m.attr("OP_MSYNC") = uint32_t(io::kMsync);
  m.attr("OP_FALLOCATE") = uint32_t(io::kFallocate);
  m.attr("OP_PMEM_DRAIN") = uint32_t(io::kPmemDrain);
  m.attr("OP_ALL") = uint32_t(io::kAll);
  m.attr("SHORT_WRITE") = io::kShortWrite;
  m.def("set_fault", &io::set_fault, py::arg("op_mask"), py::arg("nth"), py::arg("err"),
        py::arg("persistent") = false,
        "Fail the nth I/O call among op_mask with errno `err` (SHORT_WRITE: a short write).");
  m.def("clear_fault", &io::clear_fault);
  m.def("fault_calls", &io::fault_calls);

  m.def("trace_start", &io::trace_start,
        "Clear the I/O trace and record every pwrite, fdatasync, msync and posix_fallocate from now on.");
  m.def("trace_stop", &io::trace_stop, "Stop recording; calls still running finish their records.");
  m.def("trace_take", [] {
        std::vector<io::TraceRecord> recs = io::trace_take();
        py::list out;
        for (const io::TraceRecord& r : recs) {
          py::dict d;
          d["op"] = trace_op_name(r.op);
          d["tid"] = r.tid;
          d["dev"] = r.dev;
          d["ino"] = r.ino;
          d["off"] = r.off;
          d["len"] = r.len;
          d["data"] = py::bytes(r.data);
          d["begin"] = r.begin;
          d["end"] = r.end;
          d["rc"] = r.rc;
          out.append(std::move(d));
        }
        return out;
      },
      "The recorded calls in start order, as dicts: op ('pwrite', 'fdatasync', 'msync', 'fallocate'), "
      "tid, dev, ino, off, len, data (pwrite: bytes written; msync: the synced pages at the call's "
      "start), begin and end (positions in one global order; end -1 if still running), rc "
      "(0 or a negative errno). Clears the trace.");
}
