// Shared-memory collectives for tensor-parallel ranks on one host (custom_ops/collectives.py
// opens the groups and defines the ops; this file moves the bytes).
//
// Each rank owns one segment: a header (the last step it published, its pid) and two
// slots. A collective is one step, or several when the tensor is larger than a slot:
// every rank copies its part into its slot `step % 2`, publishes `step + 1`, waits until
// every peer has published it, then reads all ranks' slots. Two slots need no trailing
// barrier: a rank writes slot `s % 2` again only at step s + 2, after every peer published
// s + 1, which each does only after it finished reading step s.
//
// all_reduce sums in fp32, ranks in order 0..N-1, and rounds once: every rank computes the
// same bits. A wait checks the peers' pids while it spins (a dead rank is named within
// about a second) and gives up after the group's timeout.
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ops.h"

namespace tilefx {
namespace {

constexpr size_t kHeaderBytes = 4096;  // one page: the slots start page-aligned

struct Header {
  alignas(64) std::atomic<uint64_t> published;
  alignas(64) int64_t pid;
};

struct Segment {
  void* base = nullptr;
  size_t bytes = 0;
  Header* header() const { return static_cast<Header*>(base); }
  char* slot(int64_t index, size_t slot_bytes) const {
    return static_cast<char*>(base) + kHeaderBytes + index * slot_bytes;
  }
};

struct Group {
  int64_t rank = 0;
  size_t slot_bytes = 0;
  double timeout_s = 0;
  uint64_t step = 0;
  std::vector<Segment> segments;  // one per rank
  int64_t calls = 0;
  double seconds = 0;  // inside collectives, waits included
  double wait_seconds = 0;  // of which waiting for peers

  ~Group() {
    for (auto& s : segments)
      if (s.base != nullptr) munmap(s.base, s.bytes);
  }
};

std::mutex groups_mutex;
std::map<int64_t, std::unique_ptr<Group>> groups;
std::map<std::string, int64_t> named;  // the ops' group names bound to a shared-memory group
int64_t next_handle = 1;
// The ops' Python implementations, for groups that are not shared-memory ones (gloo). Never freed: a
// py::object destroyed after the interpreter at exit would crash it.
py::object* python_all_reduce = nullptr;
py::object* python_all_gather = nullptr;

Group& group_of(int64_t handle) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  auto it = groups.find(handle);
  TORCH_CHECK(it != groups.end(), "tilefx: no shared-memory group ", handle, " (closed, or never opened)");
  return *it->second;
}

using Clock = std::chrono::steady_clock;

// Whether `pid` is a live process: gone, or a zombie its parent has not reaped yet, counts as dead.
bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return true;  // no procfs: trust kill()
  char buffer[512] = {0};
  const size_t n = std::fread(buffer, 1, sizeof(buffer) - 1, f);
  std::fclose(f);
  const char* close_paren = std::strrchr(buffer, ')');  // "pid (comm) S ...": comm may hold spaces
  if (n == 0 || close_paren == nullptr || close_paren[1] == 0) return true;
  const char state = close_paren[2];
  return state != 'Z' && state != 'X';
}

// Until `peer` has published `target`: spin, then yield, then sleep briefly; check the peer's pid
// every ~100 ms; fail after the group's timeout naming the peer.
void wait_for(Group& g, int64_t peer, uint64_t target) {
  const Header* h = g.segments[peer].header();
  if (h->published.load(std::memory_order_acquire) >= target) return;
  const auto start = Clock::now();
  auto next_check = start + std::chrono::milliseconds(100);
  for (uint64_t spins = 1;; ++spins) {
    if (h->published.load(std::memory_order_acquire) >= target) return;
    if ((spins & 1023) != 0) continue;
    const auto now = Clock::now();
    const double waited = std::chrono::duration<double>(now - start).count();
    if (waited > 1e-3) {
      if (waited > 0.05) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      } else {
        sched_yield();
      }
    }
    if (now >= next_check) {
      next_check = now + std::chrono::milliseconds(100);
      const pid_t pid = static_cast<pid_t>(h->pid);
      TORCH_CHECK(process_alive(pid), "tilefx tensor parallel: rank ", peer, " (pid ", pid,
                  ") exited while rank ", g.rank, " waited for it at collective step ", target - 1);
      TORCH_CHECK(waited < g.timeout_s, "tilefx tensor parallel: rank ", peer, " (pid ", pid,
                  ") did not reach collective step ", target - 1, " within ", g.timeout_s,
                  " s (TILEFX_TP_TIMEOUT); rank ", g.rank, " gives up");
    }
  }
}

// Publish this rank's slot for the current step, wait for every peer; returns the slot index.
int64_t exchange(Group& g) {
  const uint64_t target = ++g.step;
  g.segments[g.rank].header()->published.store(target, std::memory_order_release);
  const auto start = Clock::now();
  for (int64_t peer = 0; peer < static_cast<int64_t>(g.segments.size()); ++peer)
    if (peer != g.rank) wait_for(g, peer, target);
  g.wait_seconds += std::chrono::duration<double>(Clock::now() - start).count();
  return static_cast<int64_t>((target - 1) & 1);
}

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}
template <>
inline float to_float<uint16_t>(uint16_t v) {  // bf16 bits
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float f) {
  return static_cast<T>(f);
}
template <>
inline uint16_t from_float<uint16_t>(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// out[i] = sum over ranks r (in order) of slot_r[i], for i in [begin, end).
template <typename T>
void reduce_range(const std::vector<const T*>& parts, T* out, int64_t begin, int64_t end) {
  constexpr int64_t kTile = 256;
  float acc[kTile];
  for (int64_t i0 = begin; i0 < end; i0 += kTile) {
    const int64_t n = std::min(kTile, end - i0);
    for (int64_t i = 0; i < n; ++i) acc[i] = to_float(parts[0][i0 + i]);
    for (size_t r = 1; r < parts.size(); ++r) {
      const T* p = parts[r] + i0;
      for (int64_t i = 0; i < n; ++i) acc[i] += to_float(p[i]);
    }
    for (int64_t i = 0; i < n; ++i) out[i0 + i] = from_float<T>(acc[i]);
  }
}

template <typename T>
void all_reduce_typed(Group& g, const T* x, T* out, int64_t numel) {
  const int64_t per_step = static_cast<int64_t>(g.slot_bytes / sizeof(T));
  const int64_t ranks = static_cast<int64_t>(g.segments.size());
  for (int64_t first = 0; first < numel; first += per_step) {
    const int64_t n = std::min(per_step, numel - first);
    const int64_t slot = static_cast<int64_t>(g.step & 1);
    std::memcpy(g.segments[g.rank].slot(slot, g.slot_bytes), x + first, n * sizeof(T));
    exchange(g);
    std::vector<const T*> parts(ranks);
    for (int64_t r = 0; r < ranks; ++r) parts[r] = reinterpret_cast<const T*>(g.segments[r].slot(slot, g.slot_bytes));
    T* dst = out + first;
    constexpr int64_t kGrain = 1 << 15;  // elements per thread: decode-sized tensors stay on one
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { reduce_range(parts, dst, begin, end); });
  }
}

struct Timed {
  Group& g;
  Clock::time_point start = Clock::now();
  explicit Timed(Group& group) : g(group) {}
  ~Timed() {
    g.calls += 1;
    g.seconds += std::chrono::duration<double>(Clock::now() - start).count();
  }
};

}  // namespace

int64_t shm_open_group(const std::vector<std::string>& paths, int64_t rank, int64_t slot_bytes, double timeout_s) {
  TORCH_CHECK(rank >= 0 && rank < static_cast<int64_t>(paths.size()), "shm_open_group: rank ", rank, " of ",
              paths.size());
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % 64 == 0, "shm_open_group: slot_bytes must be a positive multiple of 64");
  auto g = std::make_unique<Group>();
  g->rank = rank;
  g->slot_bytes = static_cast<size_t>(slot_bytes);
  g->timeout_s = timeout_s;
  const size_t bytes = kHeaderBytes + 2 * g->slot_bytes;
  for (const auto& path : paths) {
    const int fd = open(path.c_str(), O_RDWR);
    TORCH_CHECK(fd >= 0, "shm_open_group: cannot open ", path, ": ", std::strerror(errno));
    struct stat st {};
    const bool sized = fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes;
    void* base = sized ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    TORCH_CHECK(sized, "shm_open_group: ", path, " is not ", bytes, " bytes (another run's segment?)");
    TORCH_CHECK(base != MAP_FAILED, "shm_open_group: cannot map ", path, ": ", std::strerror(errno));
    g->segments.push_back({base, bytes});
  }
  Header* own = g->segments[rank].header();
  own->pid = static_cast<int64_t>(getpid());
  own->published.store(0, std::memory_order_release);
  std::lock_guard<std::mutex> lock(groups_mutex);
  groups[next_handle] = std::move(g);
  return next_handle++;
}

void shm_close_group(int64_t handle) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  for (auto it = named.begin(); it != named.end();) it = it->second == handle ? named.erase(it) : std::next(it);
  groups.erase(handle);
}

void shm_name_group(const std::string& name, int64_t handle) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  TORCH_CHECK(groups.count(handle), "shm_name_group: no group ", handle);
  named[name] = handle;
}

void set_collective_fallbacks(py::object all_reduce, py::object all_gather) {
  python_all_reduce = new py::object(std::move(all_reduce));
  python_all_gather = new py::object(std::move(all_gather));
}

namespace {
int64_t handle_named(c10::string_view name) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  auto it = named.find(std::string(name));
  return it == named.end() ? 0 : it->second;
}
}  // namespace

// Sum of `x` over the group's ranks, in x's dtype (bf16, fp16 or fp32), summed in fp32.
at::Tensor shm_all_reduce(int64_t handle, const at::Tensor& x) {
  Group& g = group_of(handle);
  Timed timed(g);
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty_like(input);
  const int64_t n = input.numel();
  switch (input.scalar_type()) {
    case at::kBFloat16:
      all_reduce_typed(g, static_cast<const uint16_t*>(input.data_ptr()), static_cast<uint16_t*>(out.data_ptr()), n);
      break;
    case at::kFloat:
      all_reduce_typed(g, input.data_ptr<float>(), out.data_ptr<float>(), n);
      break;
    case at::kHalf:
      all_reduce_typed(g, input.data_ptr<at::Half>(), out.data_ptr<at::Half>(), n);
      break;
    default:
      TORCH_CHECK(false, "tilefx.all_reduce: dtype ", input.scalar_type(), " (expected bfloat16, float16 or float32)");
  }
  return out;
}

// The ranks' `x` [..., L] side by side along the last dim: [..., ranks * L].
at::Tensor shm_all_gather(int64_t handle, const at::Tensor& x) {
  Group& g = group_of(handle);
  Timed timed(g);
  TORCH_CHECK(x.dim() >= 1, "tilefx.all_gather: expected at least one dim");
  const at::Tensor input = x.contiguous();
  const int64_t ranks = static_cast<int64_t>(g.segments.size());
  const int64_t width = input.size(-1), rows = width == 0 ? 0 : input.numel() / width;
  const int64_t row_bytes = width * input.element_size();
  std::vector<int64_t> sizes(input.sizes().begin(), input.sizes().end());
  sizes.back() = width * ranks;
  at::Tensor out = at::empty(sizes, input.options());
  if (rows == 0) return out;
  // A step carries whole rows, or one piece of a row longer than a slot.
  const int64_t piece = std::min<int64_t>(row_bytes, static_cast<int64_t>(g.slot_bytes));
  const int64_t rows_per_step = std::max<int64_t>(1, static_cast<int64_t>(g.slot_bytes) / row_bytes);
  const char* src = static_cast<const char*>(input.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t first = 0; first < rows; first += rows_per_step) {
    const int64_t n = std::min(rows_per_step, rows - first);
    for (int64_t offset = 0; offset < row_bytes; offset += piece) {
      const int64_t bytes = std::min(piece, row_bytes - offset);  // per row, this step
      const int64_t slot = static_cast<int64_t>(g.step & 1);
      char* own = g.segments[g.rank].slot(slot, g.slot_bytes);
      for (int64_t i = 0; i < n; ++i) std::memcpy(own + i * bytes, src + (first + i) * row_bytes + offset, bytes);
      exchange(g);
      for (int64_t r = 0; r < ranks; ++r) {
        const char* part = g.segments[r].slot(slot, g.slot_bytes);
        for (int64_t i = 0; i < n; ++i)
          std::memcpy(dst + ((first + i) * ranks + r) * row_bytes + offset, part + i * bytes, bytes);
      }
    }
  }
  return out;
}

// The CPU kernels of tilefx::all_reduce / all_gather (custom_ops/collectives.py defines them): a shared-memory
// group runs here without going through Python; any other group (gloo) calls the ops' Python implementations.
at::Tensor all_reduce_cpu(const at::Tensor& x, c10::string_view group) {
  if (const int64_t handle = handle_named(group)) return shm_all_reduce(handle, x);
  py::gil_scoped_acquire gil;
  TORCH_CHECK(python_all_reduce, "tilefx.all_reduce: collectives not initialised (import tilefx.custom_ops)");
  return (*python_all_reduce)(x, std::string(group)).cast<at::Tensor>();
}

at::Tensor all_gather_cpu(const at::Tensor& x, c10::string_view group, int64_t size) {
  if (const int64_t handle = handle_named(group)) {
    at::Tensor out = shm_all_gather(handle, x);
    return out.size(-1) == size ? out : out.narrow(-1, 0, size).contiguous();
  }
  py::gil_scoped_acquire gil;
  TORCH_CHECK(python_all_gather, "tilefx.all_gather: collectives not initialised (import tilefx.custom_ops)");
  return (*python_all_gather)(x, std::string(group), size).cast<at::Tensor>();
}

// (collectives, seconds inside them, seconds of those spent waiting for peers) since the group opened.
std::tuple<int64_t, double, double> shm_stats(int64_t handle) {
  Group& g = group_of(handle);
  return {g.calls, g.seconds, g.wait_seconds};
}

}  // namespace tilefx
