// Running one custom call's work on XLA's intra-op thread pool (both CPU kernels).
#ifndef JAXSERVE_CPU_KERNELS_PARALLEL_H_
#define JAXSERVE_CPU_KERNELS_PARALLEL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// Helpers a call may start beside its calling thread: one fewer than the pool has threads.
// The caller is XLA's executor thread, not a pool thread; with a helper per pool thread one
// more thread than cores would run, and a helper preempted mid-item stalls the whole call.
inline int64_t MaxHelpers(xla::ffi::ThreadPool& pool) { return pool.num_threads() - 1; }

// Runs `work()` on the calling thread and on `helpers` pool tasks, and returns once every
// task that started has returned. `work` claims items from a shared counter until none are
// left, and must own (capture) the state it reads. The caller waits only for helpers that
// started: a helper still queued when the items run out (every pool thread busy, e.g. with
// other devices' calls) starts after the call returned, finds nothing, and returns — so
// nothing ever waits on the pool. A helper registers as active before it claims an item, so
// when the caller has run out of items and sees no active helper, every item is done.
template <typename Work>
void RunWithHelpers(xla::ffi::ThreadPool& pool, int64_t helpers, const Work& work) {
  auto active = std::make_shared<std::atomic<int64_t>>(0);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([active, work] {
      active->fetch_add(1);
      work();
      active->fetch_sub(1);
    });
  }
  work();
  while (active->load() > 0) std::this_thread::yield();
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_KERNELS_PARALLEL_H_
