// Python binding of the injectable I/O layer (io.h): fault injection for the I/O-error tests.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "io.h"

namespace py = pybind11;
using namespace pcc;

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
}
