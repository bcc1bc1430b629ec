// camkv._ext's CPU plumbing shared by its primitives: argument checks whose messages
// name the argument, its bad value and what is allowed; a row-major copy for the rare
// strided input; the pool of worker threads a launch's rows run on.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace camkv {

namespace mx = mlx::core;

inline std::string shape_str(const mx::array& a) {
  std::ostringstream out;
  out << "(";
  for (int i = 0; i < a.ndim(); ++i) {
    out << (i ? ", " : "") << a.shape(i);
  }
  out << (a.ndim() == 1 ? ",)" : ")");
  return out.str();
}

[[noreturn]] inline void bad(const std::string& message) { throw std::invalid_argument(message); }

inline void check_ndim(const char* name, const mx::array& a, int ndim, const char* layout) {
  if (a.ndim() != ndim) {
    bad(std::string(name) + " must be " + layout + ", got shape " + shape_str(a));
  }
}

inline void check_dim(const char* name, const mx::array& a, int axis, int expected, const char* what) {
  if (a.shape(axis) != expected) {
    std::ostringstream out;
    out << name << " has " << a.shape(axis) << " " << what << " (axis " << axis << ") but " << expected
        << " were expected; shape " << shape_str(a);
    bad(out.str());
  }
}

inline void check_dtype(const char* name, const mx::array& a, mx::Dtype expected, const char* allowed) {
  if (a.dtype() != expected) {
    std::ostringstream out;
    out << name << " must have dtype " << allowed << ", got " << a.dtype();
    bad(out.str());
  }
}

// Storage and query arrays: one of MLX's floating dtypes.
inline void check_float_dtype(const char* name, const mx::array& a) {
  auto d = a.dtype();
  if (d != mx::float16 && d != mx::bfloat16 && d != mx::float32) {
    std::ostringstream out;
    out << name << " must have dtype float16, bfloat16 or float32, got " << d;
    bad(out.str());
  }
}

// Row-major copy of any strided array, for the rare non-contiguous input.
inline std::vector<char> contiguous_bytes(const mx::array& a) {
  size_t item = a.itemsize();
  std::vector<char> out(a.size() * item);
  const char* base = a.data<char>();
  std::vector<int> index(a.ndim(), 0);
  for (size_t flat = 0; flat < a.size(); ++flat) {
    int64_t loc = 0;
    for (int d = 0; d < a.ndim(); ++d) {
      loc += (int64_t)index[d] * a.strides()[d];
    }
    std::memcpy(out.data() + flat * item, base + loc * (int64_t)item, item);
    for (int d = a.ndim() - 1; d >= 0; --d) {
      if (++index[d] < a.shape(d)) {
        break;
      }
      index[d] = 0;
    }
  }
  return out;
}

// A fixed pool of worker threads that run the rows of one launch; the calling
// thread works too. Rows are claimed from an atomic counter.
class RowPool {
 public:
  static RowPool& instance() {
    static RowPool pool;
    return pool;
  }

  void run(int rows, int threads, const std::function<void(int)>& body) {
    threads = std::min({threads, rows, (int)workers_.size() + 1});
    if (threads <= 1) {
      for (int r = 0; r < rows; ++r) body(r);
      return;
    }
    std::unique_lock<std::mutex> launch(launch_mutex_);  // one launch at a time
    {
      std::lock_guard<std::mutex> lock(mutex_);
      body_ = &body;
      rows_ = rows;
      next_.store(0);
      helpers_wanted_ = threads - 1;
      helpers_done_ = 0;
      generation_ += 1;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return helpers_done_ == helpers_wanted_; });
    body_ = nullptr;
  }

  int size() const { return (int)workers_.size() + 1; }

 private:
  // CAMKV_THREADS caps the pool (default: every hardware thread).
  RowPool() {
    unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    if (const char* cap = std::getenv("CAMKV_THREADS")) {
      int wanted = std::atoi(cap);
      if (wanted >= 1) {
        hw = std::min(hw, (unsigned)wanted);
      }
    }
    for (unsigned i = 1; i < hw; ++i) {
      workers_.emplace_back([this, i] { work(i); });
    }
  }

  ~RowPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  void drain() {
    for (int r = next_.fetch_add(1); r < rows_; r = next_.fetch_add(1)) {
      (*body_)(r);
    }
  }

  void work(unsigned id) {
    uint64_t seen = 0;
    while (true) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || (generation_ != seen && (int)id <= helpers_wanted_); });
      if (stop_) return;
      seen = generation_;
      lock.unlock();
      drain();
      lock.lock();
      helpers_done_ += 1;
      if (helpers_done_ == helpers_wanted_) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex launch_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int)>* body_ = nullptr;
  std::atomic<int> next_{0};
  int rows_ = 0;
  int helpers_wanted_ = 0;
  int helpers_done_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};


}  // namespace camkv
