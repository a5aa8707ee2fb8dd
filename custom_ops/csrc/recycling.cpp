// Large CPU buffers kept for reuse while a forward runs. Every layer of a prefill allocates the same
// large intermediates (a MoE layer's routed rows: ~270 MB at 4096 tokens of DeepSeek-V2-Lite; gate/up's
// output: 64 MB at 4096 tokens of Llama-3.2-1B), and glibc serves each block over 32 MiB as a fresh
// mapping and returns it on free: every layer faults its pages in again, and the kernel zeroes each page
// first (docs/PERFORMANCE.md: 4-5% of a prefill's CPU time on a Zen 4 KVM guest, more where the GEMMs
// run faster). While a hold is open (the runtime holds one per forward, custom_ops/buffers.py) a freed
// block of at least `min_bytes` is kept, and a later request it fits (its size up to an eighth above the
// request) takes it back; closing the last hold frees what is kept. Outside a hold, nothing is kept.
//
// The recycler is installed as PyTorch's CPU allocator on the first hold, over the allocator it finds
// there, which still makes and frees every block: Inductor's buffers, ATen's and the ops' outputs all go
// through it. Blocks the previous allocator made before the install free through their own deleters.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ops.h"

namespace tilefx {
namespace {

constexpr std::size_t kDefaultMinBytes = std::size_t{1} << 20;

class Recycler final : public c10::Allocator {
 public:
  explicit Recycler(c10::Allocator* previous) : previous_(previous) {}

  c10::DataPtr allocate(std::size_t n) override {
    if (n < min_bytes_.load(std::memory_order_relaxed)) return previous_->allocate(n);
    std::lock_guard<std::mutex> lock(mutex_);
    void* data = holds_ > 0 ? take(n) : nullptr;
    if (data == nullptr) {
      c10::DataPtr block = previous_->allocate(n);
      data = block.get();
      blocks_.emplace(data, Block{std::move(block), n});
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void hold(std::size_t min_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (holds_++ == 0) min_bytes_ = min_bytes;
  }

  void unhold() {
    std::vector<c10::DataPtr> freed;  // destroyed after the lock is let go: the previous allocator frees them
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(holds_ > 0, "tilefx: release_recycled_buffers without a hold");
    if (--holds_ > 0) return;
    for (const auto& kept : kept_) {
      auto it = blocks_.find(kept.second);
      freed.push_back(std::move(it->second.block));
      blocks_.erase(it);
    }
    kept_.clear();
    kept_bytes_ = 0;
    min_bytes_ = kDefaultMinBytes;
  }

  std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {holds_, static_cast<int64_t>(kept_.size()), static_cast<int64_t>(kept_bytes_), reused_, made_};
  }

  static Recycler* installed;

 private:
  struct Block {
    c10::DataPtr block;  // the previous allocator's
    std::size_t bytes;
  };

  // The smallest kept block that `n` bytes fit, at most n / 8 above them; nullptr if none.
  void* take(std::size_t n) {
    auto it = kept_.lower_bound(n);
    if (it == kept_.end() || it->first - n > n / 8) {
      ++made_;
      return nullptr;
    }
    void* data = it->second;
    kept_bytes_ -= it->first;
    kept_.erase(it);
    ++reused_;
    return data;
  }

  // A block's deleter (and raw_deleter: raw_allocate's small blocks are the previous allocator's).
  static void release(void* data) { installed->give_back(data); }
  void give_back(void* data) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = blocks_.find(data);
    if (it == blocks_.end()) {
      lock.unlock();
      previous_->raw_deleter()(data);
    } else if (holds_ > 0) {
      kept_.emplace(it->second.bytes, data);
      kept_bytes_ += it->second.bytes;
    } else {
      c10::DataPtr freed = std::move(it->second.block);
      blocks_.erase(it);
      lock.unlock();  // the previous allocator frees it outside the lock
    }
  }

  c10::Allocator* const previous_;
  std::atomic<std::size_t> min_bytes_{kDefaultMinBytes};
  std::mutex mutex_;
  int64_t holds_ = 0;
  std::unordered_map<void*, Block> blocks_;  // every live or kept block this allocator made
  std::multimap<std::size_t, void*> kept_;    // the kept ones by size
  std::size_t kept_bytes_ = 0;
  int64_t reused_ = 0, made_ = 0;  // large requests while held: served by a kept block, or by a new one
};

Recycler* Recycler::installed = nullptr;

// Installed once, never destroyed: tensors may outlive every hold, and free through it at exit.
Recycler& recycler() {
  static Recycler* const instance = [] {
    auto* r = new Recycler(c10::GetCPUAllocator());
    Recycler::installed = r;
    c10::SetCPUAllocator(r, /*priority=*/0);
    return r;
  }();
  return *instance;
}

}  // namespace

void hold_recycled_buffers(int64_t min_bytes) {
  TORCH_CHECK(min_bytes >= 1, "tilefx: hold_recycled_buffers: min_bytes must be at least 1, got ", min_bytes);
  recycler().hold(static_cast<std::size_t>(min_bytes));
}

void release_recycled_buffers() { recycler().unhold(); }

std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> recycled_buffer_stats() { return recycler().stats(); }

}  // namespace tilefx
