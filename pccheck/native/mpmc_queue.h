// Bounded lock-free multi-producer multi-consumer queue (D. Vyukov's array queue), plus a
// blocking wrapper whose fast path stays lock-free and which only takes a mutex to sleep.
// Holds free DRAM chunk ids, free slot ids and writer tasks.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>

namespace pcc {

template <typename T>
class MPMCQueue {
 public:
  explicit MPMCQueue(size_t min_capacity) {
    size_t cap = 2;
    while (cap < min_capacity) cap <<= 1;
    mask_ = cap - 1;
    cells_.reset(new Cell[cap]);
    for (size_t i = 0; i < cap; i++) cells_[i].seq.store(i, std::memory_order_relaxed);
  }
  size_t capacity() const { return mask_ + 1; }

  // Invariant: cell i holds an item exactly when its seq == position + 1 for the position that
  // wrote it; a producer owns a cell when seq == position, a consumer when seq == position + 1.
  bool try_push(T v) {
    size_t pos = enq_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& c = cells_[pos & mask_];
      size_t seq = c.seq.load(std::memory_order_acquire);
      intptr_t dif = static_cast<intptr_t>(seq) - static_cast<intptr_t>(pos);
      if (dif == 0) {
        if (enq_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          c.data = std::move(v);
          c.seq.store(pos + 1, std::memory_order_release);
          return true;
        }
      } else if (dif < 0) {
        return false;  // full
      } else {
        pos = enq_.load(std::memory_order_relaxed);
      }
    }
  }

  bool try_pop(T& out) {
    size_t pos = deq_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& c = cells_[pos & mask_];
      size_t seq = c.seq.load(std::memory_order_acquire);
      intptr_t dif = static_cast<intptr_t>(seq) - static_cast<intptr_t>(pos + 1);
      if (dif == 0) {
        if (deq_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          out = std::move(c.data);
          c.data = T();
          c.seq.store(pos + mask_ + 1, std::memory_order_release);
          return true;
        }
      } else if (dif < 0) {
        return false;  // empty
      } else {
        pos = deq_.load(std::memory_order_relaxed);
      }
    }
  }

 private:
  struct Cell {
    std::atomic<size_t> seq;
    T data{};
  };
  std::unique_ptr<Cell[]> cells_;
  size_t mask_;
  alignas(64) std::atomic<size_t> enq_{0};
  alignas(64) std::atomic<size_t> deq_{0};
};

// Lock-free push/pop with sleeping waits. No busy-wait loops: a consumer that finds the queue
// empty registers as a waiter under the mutex and sleeps on the condition variable.
template <typename T>
class BlockingQueue {
 public:
  explicit BlockingQueue(size_t min_capacity) : q_(min_capacity) {}

  bool push(T v) {
    if (!q_.try_push(std::move(v))) return false;
    // Dekker pair with pop(): push-then-read-waiters vs register-waiter-then-retry.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (waiters_.load(std::memory_order_relaxed) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_one();
    }
    return true;
  }

  bool try_pop(T& out) { return q_.try_pop(out); }

  // Waits up to timeout_s (< 0: forever). False on timeout, or when closed and empty.
  bool pop(T& out, double timeout_s = -1.0) {
    if (q_.try_pop(out)) return true;
    std::unique_lock<std::mutex> lk(mu_);
    waiters_.fetch_add(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(timeout_s < 0 ? 0 : timeout_s));
    bool ok = false;
    for (;;) {
      if (q_.try_pop(out)) {
        ok = true;
        break;
      }
      if (closed_) break;
      if (timeout_s < 0) {
        cv_.wait(lk);
      } else if (cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
        ok = q_.try_pop(out);
        break;
      }
    }
    waiters_.fetch_sub(1, std::memory_order_relaxed);
    return ok;
  }

  bool closed() {
    std::lock_guard<std::mutex> lk(mu_);
    return closed_;
  }

  // Wakes every waiter; pops still drain what is left, then return false.
  void close() {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
    cv_.notify_all();
  }

 private:
  MPMCQueue<T> q_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> waiters_{0};
  bool closed_ = false;
};

}  // namespace pcc
