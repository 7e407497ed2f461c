// Python binding: converts types, releases the GIL around everything that copies, writes or
// waits, and maps native errors to OSError (with errno) or ValueError. No logic lives here.
#include <cstring>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "crc32c.h"
#include "engine.h"
#include "fingerprint.h"
#include "format.h"
#include "io.h"
#include "ntcopy.h"
#include "store.h"
#include "write_watch.h"

namespace py = pybind11;
using namespace pcc;

void bind_io(py::module_& m);  // binding_io.cpp

namespace {

[[noreturn]] void throw_rc(int rc, const std::string& what) { throw NativeError(-rc, what); }

Mode parse_mode(const std::string& m) {
  if (m == "odirect") return Mode::kODirect;
  if (m == "mmap") return Mode::kMmap;
  if (m == "pmem") return Mode::kPmem;
  throw std::invalid_argument("unknown write mode '" + m + "' (odirect, mmap or pmem)");
}

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kODirect: return "odirect";
    case Mode::kMmap: return "mmap";
    case Mode::kPmem: return "pmem";
  }
  return "?";
}

#define PCC_DICT_ITEM(type, name, offset) d[#name] = h.name;

py::dict header_dict(const Header& h) {
  py::dict d;
  PCC_HEADER_FIELDS(PCC_DICT_ITEM)
  d["file_size"] = h.file_size();
  return d;
}

py::list field_table(const std::vector<FieldInfo>& fields) {
  py::list out;
  for (const FieldInfo& f : fields) out.append(py::make_tuple(f.name, f.offset, f.size, f.is_signed));
  return out;
}

py::buffer_info read_buffer(const py::buffer& b) { return b.request(); }

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "pccheck native core: queue, store + commit protocol, chunk pool, writers, crc32c";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const NativeError& e) {
      py::object exc = py::module_::import("builtins").attr("OSError")(e.err, e.what());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.attr("BLOCK") = kBlock;
  m.attr("MAX_SLOTS") = kMaxSlots;
  m.attr("FORMAT_VERSION") = kFormatVersion;
  m.attr("CHECK_ADDR_OFFSET") = kCheckAddrOffset;

  m.def("crc32c", [](const py::buffer& b, uint32_t crc) {
        py::buffer_info info = read_buffer(b);
        const void* p = info.ptr;
        size_t n = static_cast<size_t>(info.size * info.itemsize);
        py::gil_scoped_release nogil;
        return crc32c_update(crc, p, n);
      },
      py::arg("data"), py::arg("crc") = 0, "crc32c of a contiguous buffer (continues `crc`).");
  m.def("prefault", [](const py::buffer& b) {
        py::buffer_info info = b.request(true);
        uint8_t* p = static_cast<uint8_t*>(info.ptr);
        size_t n = static_cast<size_t>(info.size * info.itemsize);
        py::gil_scoped_release nogil;
        prefault(p, n);
      },
      py::arg("data"),
      "Faults in every page of a writable buffer (MADV_POPULATE_WRITE, else one write per page), "
      "so a later O_DIRECT read into it does not pay the first touch.");
  m.def("fingerprint", [](uintptr_t ptr, uint64_t nbytes, uint64_t itemsize, std::vector<int64_t> shape,
                          std::vector<int64_t> strides, uint64_t key1, uint64_t key2) {
        if (shape.size() != strides.size() || shape.size() > 64) throw std::invalid_argument("bad array shape/strides");
        ArraySource s;
        s.ptr = reinterpret_cast<const uint8_t*>(ptr);
        s.nbytes = nbytes;
        s.itemsize = itemsize;
        s.shape = std::move(shape);
        s.strides = std::move(strides);
        s.prepare();
        py::gil_scoped_release nogil;
        return fingerprint(s, key1, key2);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("itemsize"), py::arg("shape"), py::arg("strides"), py::arg("key1"),
      py::arg("key2"),
      "(H_key1, H_key2): the array's 2 x 61-bit polynomial fingerprint over its logical bytes (fingerprint.h).");
  py::class_<WriteWatch>(m, "WriteWatch",
                         "Kernel write tracking of host memory ranges (write_watch.h); raises RuntimeError "
                         "saying why where the kernel lacks it.")
      .def(py::init<>())
      .def("arm", [](WriteWatch& w, uint64_t lo, uint64_t hi) {
            py::gil_scoped_release nogil;
            return w.arm(lo, hi);
          },
          py::arg("lo"), py::arg("hi"),
          "Registers and protects [lo, hi); ([(start, end)] not protected before, rc: 0 or -errno).")
      .def("scan", [](WriteWatch& w, uint64_t lo, uint64_t hi) {
            py::gil_scoped_release nogil;
            return w.scan(lo, hi);
          },
          py::arg("lo"), py::arg("hi"),
          "([(start, end)] written, not present or file-backed since protected, now protected again; rc).");
  m.def("crc32c_combine", &crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"));
  m.def("crc32c_hardware", &crc32c_hardware);
  m.def("have_libpmem", &have_libpmem);
  m.def("ntcopy_kernel", &ntcopy_kernel);

  bind_io(m);  // fault injection and I/O tracing: binding_io.cpp

  m.def("create_store", &create_store, py::arg("path"), py::arg("num_slots"), py::arg("slot_capacity"),
        py::arg("generation"), py::arg("world_size") = 1, py::arg("rank") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("parse_header", [](const py::bytes& b) {
        std::string s = b;
        Header h;
        std::string why = parse_header(reinterpret_cast<const uint8_t*>(s.data()), s.size(), &h);
        if (!why.empty()) throw std::invalid_argument(why);
        py::dict d = header_dict(h);
        uint64_t word = 0;
        std::memcpy(&word, s.data() + kCheckAddrOffset, sizeof(word));
        d["check_word"] = word;
        return d;
      },
      "Parse and validate block 0 (FORMAT.md §2). Raises ValueError saying what is wrong.");
  m.def("parse_meta", [](const py::bytes& b, uint32_t slot, uint64_t slot_capacity) -> py::object {
        std::string s = b;
        Header h;
        h.slot_capacity = slot_capacity;
        Meta mt;
        std::string why = parse_meta(reinterpret_cast<const uint8_t*>(s.data()), s.size(), h, slot, &mt);
        if (why == "empty") return py::none();
        if (!why.empty()) throw std::invalid_argument(why);
        py::dict d;
        // Every field but the version, which parse_meta has checked is the one this build reads.
#define PCC_META_ITEM(type, name, offset) \
  if (std::strcmp(#name, "version") != 0) d[#name] = mt.name;
        PCC_META_FIELDS(PCC_META_ITEM)
#undef PCC_META_ITEM
        return d;
      },
      "Parse and validate a meta record (FORMAT.md §3): dict, None when empty, ValueError if invalid.");
  m.def("header_fields", [] { return field_table(header_fields()); },
        "The header's fields (FORMAT.md §2) as this build packs them: (name, offset, size, signed).");
  m.def("meta_fields", [] { return field_table(meta_fields()); },
        "The meta record's fields (FORMAT.md §3) as this build packs them: (name, offset, size, signed).");
  m.def("word_counter", &word_counter);
  m.def("word_slot", &word_slot);
  m.def("make_word", &make_word);

  py::class_<Store, std::shared_ptr<Store>>(m, "Store")
      .def(py::init([](const std::string& path, const std::string& mode) {
             Mode md = parse_mode(mode);
             py::gil_scoped_release nogil;
             return std::make_shared<Store>(path, md);
           }),
           py::arg("path"), py::arg("mode"))
      .def_property_readonly("header", [](const Store& s) { return header_dict(s.header()); })
      .def_property_readonly("mode", [](const Store& s) { return std::string(mode_name(s.mode())); })
      .def_property_readonly("is_pmem", &Store::is_pmem)
      .def_property_readonly("check_word", &Store::check_word)
      .def("init", [](Store& s, uint64_t word, uint64_t next_counter, std::vector<uint32_t> protect) {
             int rc;
             {
               py::gil_scoped_release nogil;
               rc = s.init(word, next_counter, protect);
             }
             if (rc) throw_rc(rc, "cannot persist the recovered CHECK_ADDR");
           },
           py::arg("word"), py::arg("next_counter"), py::arg("protect") = std::vector<uint32_t>{})
      .def("set_hold_replaced", &Store::set_hold_replaced)
      .def("take_held", &Store::take_held)
      .def("next_counter", &Store::next_counter)
      .def("acquire_slot", [](Store& s, double timeout, bool zero_meta) -> py::object {
             int rc;
             {
               py::gil_scoped_release nogil;
               rc = s.acquire_slot(timeout, zero_meta);
             }
             if (rc == -ETIMEDOUT) return py::none();
             if (rc < 0) throw_rc(rc, "cannot invalidate the meta record of a free slot");
             return py::int_(rc);
           },
           py::arg("timeout") = -1.0, py::arg("zero_meta") = true)
      .def("release_slot", &Store::release_slot)
      .def("settle_word", [](Store& s) {
             int rc;
             {
               py::gil_scoped_release nogil;
               rc = s.settle_word();
             }
             if (rc < 0) throw_rc(rc, "cannot persist CHECK_ADDR");
           },
           "Persists the word in memory again after a failed word barrier (OSError if it fails again); "
           "the slots it replaced are then free.")
      .def("commit", [](Store& s, uint32_t slot, uint64_t counter, int64_t step, const py::bytes& manifest,
                        uint64_t manifest_offset, uint64_t data_len) {
             std::string mf = manifest;
             int rc;
             {
               py::gil_scoped_release nogil;
               rc = s.commit(slot, counter, step, mf, manifest_offset, data_len);
             }
             if (rc < 0) throw_rc(rc, "checkpoint commit failed");
             return rc == 1;
           },
           py::arg("slot"), py::arg("counter"), py::arg("step"), py::arg("manifest"),
           py::arg("manifest_offset"), py::arg("data_len"),
           "FORMAT.md §4 steps 3-5. True: this checkpoint is now the durable latest; False: a newer one won.")
      .def("free_slots", &Store::free_slots)
      .def("populate", &Store::populate, py::call_guard<py::gil_scoped_release>(),
           "mmap mode: faults every page of the store's mapping in (for tmpfs); returns the bytes done.")
      .def("close", &Store::close, py::call_guard<py::gil_scoped_release>());

  py::class_<Job, std::shared_ptr<Job>>(m, "Job")
      .def("copy", &Job::copy, py::arg("until") = 0, py::call_guard<py::gil_scoped_release>(),
           "Claim, fill and hand to the writers every unclaimed chunk (those holding stream bytes "
           "below `until`, if > 0). Several threads may call it at once. GIL released.")
      .def("wait_copied", &Job::wait_copied, py::arg("timeout") = -1.0,
           py::call_guard<py::gil_scoped_release>(), "True once every chunk is filled.")
      .def("wait", &Job::wait, py::arg("timeout") = -1.0, py::call_guard<py::gil_scoped_release>(),
           "True once every chunk is written (or the job failed).")
      .def("claim", &Job::claim, "Next chunk index to fill, or -1 when all are claimed.")
      .def("acquire_chunk", &Job::acquire_chunk, py::arg("timeout") = -1.0,
           py::call_guard<py::gil_scoped_release>(), "A free chunk id (waits: back-pressure); -1 on timeout.")
      .def("fill", &Job::fill, py::arg("k"), py::arg("chunk"), py::call_guard<py::gil_scoped_release>(),
           "Fill chunk k from host-memory sources (memcpy).")
      .def("fill_to", [](const Job& j, uint64_t k, uintptr_t address, uint64_t capacity) {
             j.fill_to(k, reinterpret_cast<uint8_t*>(address), capacity);
           }, py::arg("k"), py::arg("address"), py::arg("capacity"), py::call_guard<py::gil_scoped_release>(),
           "Fill chunk k's bytes into host memory at `address` (>= chunk_len(k) bytes) instead of a "
           "pool chunk: the CPU engine's stand-in for a device reserve.")
      .def("chunk_len", &Job::chunk_len, py::arg("k"), "Bytes of the stream in chunk k.")
      .def("submit", &Job::submit, py::arg("k"), py::arg("chunk"), "Hand filled chunk k to the writers.")
      .def("release_chunk", &Job::release_chunk, py::arg("chunk"),
           "Return an acquired chunk that will not be submitted (a failed device copy) to the pool.")
      .def("skip", &Job::skip, py::arg("k"), py::arg("err"), "Give up chunk k, failing the job with -err.")
      .def("in_place_chunk", [](Job& j, uint64_t k) {
             return reinterpret_cast<uintptr_t>(j.in_place_chunk(k));
           }, py::arg("k"), py::call_guard<py::gil_scoped_release>(),
           "In-place jobs: the address of claimed chunk k in the slot (0 when not in place); waits for a "
           "writer task. Then submit_in_place(k), or skip(k, err) and release_in_place().")
      .def("submit_in_place", &Job::submit_in_place, py::arg("k"), "Hand chunk k, filled in the slot, to the writers.")
      .def("release_in_place", &Job::release_in_place, "Give back in_place_chunk's writer task (after skip).")
      .def_property_readonly("in_place", &Job::in_place)
      .def_property_readonly("error", &Job::error)
      .def_property_readonly("crcs", &Job::crcs)
      .def_property_readonly("slot", &Job::slot)
      .def_property_readonly("num_chunks", &Job::num_chunks)
      .def_property_readonly("copy_seconds", &Job::copy_seconds)
      .def("add_copy_seconds", &Job::add_copy_seconds, py::arg("seconds"),
           "Copy time of a chunk filled by an external (device) engine, for the statistics.")
      .def_property_readonly("backpressure_seconds", &Job::backpressure_seconds);

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init([](uint64_t chunk_size, uint32_t num_chunks, uint32_t writer_threads) {
             py::gil_scoped_release nogil;
             return std::make_shared<Engine>(chunk_size, num_chunks, writer_threads);
           }),
           py::arg("chunk_size"), py::arg("num_chunks"), py::arg("writer_threads"))
      .def("begin", [](Engine& e, std::shared_ptr<Store> store, uint32_t slot, const py::list& sources,
                       uint64_t stream_len, bool zero_meta, bool in_place, const py::list& extents) {
             std::vector<ArraySource> srcs;
             srcs.reserve(sources.size());
             for (const py::handle& item : sources) {
               auto t = item.cast<py::tuple>();
               if (t.size() != 6) throw std::invalid_argument("source is (ptr, offset, nbytes, itemsize, shape, strides)");
               ArraySource s;
               s.ptr = reinterpret_cast<const uint8_t*>(t[0].cast<uintptr_t>());
               s.offset = t[1].cast<uint64_t>();
               s.nbytes = t[2].cast<uint64_t>();
               s.itemsize = t[3].cast<uint64_t>();
               s.shape = t[4].cast<std::vector<int64_t>>();
               s.strides = t[5].cast<std::vector<int64_t>>();
               srcs.push_back(std::move(s));
             }
             std::vector<Extent> exts;
             exts.reserve(extents.size());
             for (const py::handle& item : extents) {
               auto t = item.cast<py::tuple>();
               if (t.size() != 3) throw std::invalid_argument("extent is (stream_off, len, file_off)");
               exts.push_back({t[0].cast<uint64_t>(), t[1].cast<uint64_t>(), t[2].cast<uint64_t>()});
             }
             return e.begin(std::move(store), slot, std::move(srcs), stream_len, zero_meta, in_place,
                            std::move(exts));
           },
           py::arg("store"), py::arg("slot"), py::arg("sources"), py::arg("stream_len"), py::arg("zero_meta") = false,
           py::arg("in_place") = false, py::arg("extents") = py::list())
      .def_property_readonly("chunk_size", &Engine::chunk_size)
      .def_property_readonly("num_chunks", &Engine::num_chunks)
      .def("free_chunks", &Engine::free_chunks)
      .def_property_readonly("prefaulted_chunks", &Engine::prefaulted_chunks)
      .def("wait_prefaulted", &Engine::wait_prefaulted, py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("pool_address", &Engine::pool_address)
      .def_property_readonly("pool_bytes", &Engine::pool_bytes)
      .def("chunk_address", &Engine::chunk_address)
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>());
}
