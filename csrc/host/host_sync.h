// Host-memory flag protocol helpers (the CPU-device backend): the same Ctrl block and flag
// encoding as the CUDA kernels (layout.h), with C++ atomics instead of PTX.
//
// Protocol for one host call (pull model, every rank a thread or process):
//   s = ctrl.seq + 1, parity p = s & 1
//   1. write my input into my own buffer's half p
//   2. publish: store-release make_flag(s, desc) into flags[p][phase][me][0] of every peer
//   3. wait (bounded, yielding) until flags[p][phase][src][0] == make_flag(s, desc) for all src
//   4. read the peers' halves p and compute
//   5. ctrl.seq = s
// Safety of two halves: a rank at call s+2 has seen every peer's flag of call s+1, raised only
// after that peer finished reading call s, so overwriting half p (= parity of s) is safe.
#pragma once
#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "../common/layout.h"

namespace nvc {
namespace host {

inline uint64_t load_acquire(const uint64_t* p) {
  return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(p)).load(std::memory_order_acquire);
}
inline void store_release(uint64_t* p, uint64_t v) {
  std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_release);
}

inline uint64_t begin_call(const CommView& v) { return load_acquire(&v.ctrl()->seq) + 1; }
inline void end_call(const CommView& v, uint64_t seq) { store_release(&v.ctrl()->seq, seq); }

// Raise my flag for (seq, desc, phase) in every rank's buffer (mine included).
inline void publish(const CommView& v, uint64_t seq, uint32_t desc, int phase) {
  const uint64_t f = make_flag(seq, desc);
  for (int r = 0; r < v.world; ++r)
    store_release(&v.peer_ctrl(r)->flags[seq & 1][phase][v.rank][0], f);
}

// Record an error (first wins) and return its text.
std::string record_error(const CommView& v, uint32_t code, uint32_t desc, int peer, uint64_t seq,
                         uint64_t observed);

// Wait until every rank's flag for (seq, desc, phase) arrived. "" on success, else the error.
inline std::string wait_all(const CommView& v, uint64_t seq, uint32_t desc, int phase) {
  const uint64_t want = make_flag(seq, desc);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(v.timeout_ns);
  for (int src = 0; src < v.world; ++src) {
    const uint64_t* fp = &v.ctrl()->flags[seq & 1][phase][src][0];
    uint32_t spins = 0;
    while (true) {
      uint64_t f = load_acquire(fp);
      if (f == want) break;
      if (flag_seq(f) == seq) return record_error(v, kErrMismatch, desc, src, seq, f);
      if (flag_seq(f) > seq) return record_error(v, kErrAhead, desc, src, seq, f);
      if (++spins < 64) continue;
      if ((spins & 63u) == 0 && std::chrono::steady_clock::now() > deadline)
        return record_error(v, kErrTimeout, desc, src, seq, f);
      if (spins < 4096) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return "";
}

}  // namespace host
}  // namespace nvc
