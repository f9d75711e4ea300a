// The fused call's hot case in one native call: a torch extension (the only torch-dependent native code here).
//
// A helper's eager call spends most of its host time before the launch in Python: reading the tensor's
// metadata, building its signature, looking up its proposal, writing the vote row, converting the ctypes
// arguments. HotCalls holds, per signature the helper has already launched fused, what those steps found (the
// output shape, the launch's fvk_call, the vote row) and does the rest in C++: match the tensor's metadata,
// check the stream is not capturing, allocate the output, write the call's SEQ word, and make the voted
// fvk_launch. Python stays the oracle: it fills the table only from calls it proposed, voted and launched
// itself, and it acts on every outcome (the stage the library reports) exactly as after its own launch. A
// call this table does not hold (another signature, a capture, a non-contiguous or misaligned input) is
// returned as None before anything is done (so is one whose output cannot be allocated), and takes the
// Python path.
//
// Built against the installed torch (fastvideo-kernel/build_hot.py), with FVK_HOT_CUDA where torch has CUDA.
// No kernel library is linked: the launch entry, the context and the vote come in as addresses from the
// library the transport loaded.

#include <torch/extension.h>
#include <torch/version.h>

#include <array>
#include <cstdint>
#include <vector>

#ifdef FVK_HOT_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "ulysses_a2a.h"

namespace {

using LaunchFn = int (*)(fvk_ctx*, const fvk_call*, const void*, void*, void*, fvk_vote*);

// Bump with any change of what run() returns or add() takes (the Python side checks it).
constexpr int64_t kInterface = 1;

struct Entry {
  std::array<int64_t, 4> shape;
  int64_t mode;
  c10::ScalarType dtype;
  c10::Device device;
  std::vector<int64_t> out_shape;
  const fvk_call* call;  // the launch's call description (hot.HotPath keeps it alive while the entry lives)
  int64_t* row;          // the proposal's vote send row (hot.HotPath keeps its words alive likewise)
};

class HotCalls {
 public:
  // `launch`: fvk_launch's address; `ctx`: the transport's fvk_ctx; `vote`: its fvk_vote (the voted form's
  // handle and buffers, reused by every call); `seq_field`: the SEQ word's index in a vote row.
  HotCalls(uint64_t launch, uint64_t ctx, uint64_t vote, int64_t seq_field)
      : launch_(reinterpret_cast<LaunchFn>(launch)),
        ctx_(reinterpret_cast<fvk_ctx*>(ctx)),
        vote_(reinterpret_cast<fvk_vote*>(vote)),
        seq_field_(seq_field) {
    TORCH_CHECK(launch != 0 && vote != 0, "HotCalls: the launch entry and the vote must be non-null");
    TORCH_CHECK(seq_field >= 0 && seq_field < FVK_VOTE_FIELDS, "HotCalls: seq_field out of range");
  }

  // Hold the signature of `like` (shape, dtype, device; contiguous, aligned) in `mode`. Returns its slot, the
  // index run() reports. The caller keeps `call` and `row` alive until clear() or close().
  int64_t add(const at::Tensor& like, int64_t mode, std::vector<int64_t> out_shape, uint64_t call, uint64_t row) {
    TORCH_CHECK(!closed_, "HotCalls.add after close()");
    TORCH_CHECK(like.dim() == 4, "HotCalls.add: a 4-D tensor, got ", like.dim(), " dims");
    TORCH_CHECK(call != 0 && row != 0, "HotCalls.add: the call description and the vote row must be non-null");
    auto s = like.sizes();
    entries_.push_back(Entry{{s[0], s[1], s[2], s[3]},
                             mode,
                             like.scalar_type(),
                             like.device(),
                             std::move(out_shape),
                             reinterpret_cast<const fvk_call*>(call),
                             reinterpret_cast<int64_t*>(row)});
    return static_cast<int64_t>(entries_.size()) - 1;
  }

  // Forget every signature (a replan): run() finds none until add() again.
  void clear() { entries_.clear(); }

  // Forget every signature and refuse new ones (the transport or the vote is gone).
  void close() {
    entries_.clear();
    closed_ = true;
  }

  int64_t size() const { return static_cast<int64_t>(entries_.size()); }

  // One call of a held signature: None when x is not one (nothing done, nothing voted); else
  // (out, slot, stage, status, stream): the library's voted fvk_launch made, SEQ = `seq`.
  py::object run(const at::Tensor& x, int64_t mode, int64_t seq) {
    const int64_t slot = find(x, mode);
    if (slot < 0) return py::none();
    const Entry& e = entries_[slot];
    void* stream = nullptr;  // a CPU tensor (the CPU tests' stand-in library): no stream
#ifdef FVK_HOT_CUDA
    if (x.is_cuda()) {
      cudaStream_t raw = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      // A capture takes the Python path (one vote at capture, the plan frozen); a failed query too.
      if (cudaStreamIsCapturing(raw, &status) != cudaSuccess || status != cudaStreamCaptureStatusNone) {
        (void)cudaGetLastError();
        return py::none();
      }
      stream = raw;
    }
#endif
    at::Tensor out;
    try {
      out = at::empty(e.out_shape, x.options());
    } catch (const std::exception&) {
      return py::none();  // nothing voted: the Python path allocates again and votes its failure
    }
    e.row[seq_field_] = seq;
    vote_->fields = e.row;
    int status;
    {
      // The exchange waits for the peers: other threads (the watchdog) run meanwhile, as with ctypes.
      py::gil_scoped_release unlocked;
      status = launch_(ctx_, e.call, x.data_ptr(), out.data_ptr(), stream, vote_);
    }
    return py::make_tuple(std::move(out), slot, vote_->stage, status, reinterpret_cast<uint64_t>(stream));
  }

 private:
  int64_t find(const at::Tensor& x, int64_t mode) const {
    if (entries_.empty() || x.dim() != 4) return -1;
    auto s = x.sizes();
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      if (e.mode == mode && e.shape[0] == s[0] && e.shape[1] == s[1] && e.shape[2] == s[2] && e.shape[3] == s[3] &&
          e.dtype == x.scalar_type() && e.device == x.device()) {
        // The proposal was made for a contiguous, element-aligned input: another one is another signature.
        if (!x.is_contiguous() || reinterpret_cast<uintptr_t>(x.data_ptr()) % x.element_size() != 0) return -1;
        return static_cast<int64_t>(i);
      }
    }
    return -1;
  }

  LaunchFn launch_;
  fvk_ctx* ctx_;
  fvk_vote* vote_;
  int64_t seq_field_;
  std::vector<Entry> entries_;
  bool closed_ = false;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The fused call's hot case in one native call (fastvideo/distributed/ulysses/hot.py).";
  m.attr("INTERFACE") = kInterface;
  m.attr("TORCH_VERSION") = py::make_tuple(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
#ifdef FVK_HOT_CUDA
  m.attr("CUDA") = true;
#else
  m.attr("CUDA") = false;
#endif
  py::class_<HotCalls>(m, "HotCalls")
      .def(py::init<uint64_t, uint64_t, uint64_t, int64_t>(), py::arg("launch"), py::arg("ctx"), py::arg("vote"),
           py::arg("seq_field"))
      .def("add", &HotCalls::add, py::arg("like"), py::arg("mode"), py::arg("out_shape"), py::arg("call"),
           py::arg("row"))
      .def("clear", &HotCalls::clear)
      .def("close", &HotCalls::close)
      .def("__len__", &HotCalls::size)
      .def("run", &HotCalls::run, py::arg("x"), py::arg("mode"), py::arg("seq"));
}
