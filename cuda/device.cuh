// Device primitives every moecomm kernel may use, whatever the transport: the clock, ordered loads, the
// error word and bounded waits on local signals. Constants (MOECOMM_*) and parameter structs come from the
// generated moecomm_abi.h (moecomm/_abi.py).
#pragma once
#include "moecomm_abi.h"

// Build option MOECOMM_TRACE=1 (tools/trace_kernels.py): stamps of the SM clock where each half's stages end,
// by thread 0 of the block that takes the half's first token or record (block 0 in the send halves, the
// grid's last block in the receive halves; TRACE(half, point), points 0..MOECOMM_TRACE_POINTS-2), and the
// clocks the last block spends on its signals and counters (from TRACE_LAST_START to TRACE_LAST, the half's
// final point). Each kernel also stamps its span (TRACE_SPAN(half it starts with, 0 at entry / 1 at exit),
// thread 0 of every block): the global timer's first and last block entry and exit (atomicMin/atomicMax),
// and block 0's SM clock and global timer at entry and exit (the clock's real rate). Compiled out otherwise.
#if MOECOMM_TRACE
extern "C" __device__ unsigned long long moecomm_trace[MOECOMM_TRACE_HALVES * MOECOMM_TRACE_POINTS];
extern "C" __device__ unsigned long long moecomm_span[MOECOMM_TRACE_HALVES * MOECOMM_TRACE_SPAN];
#define TRACE_SPAN(half, at)                                                               \
  do {                                                                                     \
    if (threadIdx.x == 0) {                                                                \
      unsigned long long t_;                                                               \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                               \
      unsigned long long* s_ = moecomm_span + (half) * MOECOMM_TRACE_SPAN;                 \
      atomicMin(s_ + 2 * (at), t_);                                                        \
      atomicMax(s_ + 2 * (at) + 1, t_);                                                    \
      if (blockIdx.x == 0) {                                                               \
        s_[4 + (at)] = clock64();                                                          \
        s_[6 + (at)] = t_;                                                                 \
      }                                                                                    \
    }                                                                                      \
  } while (0)
#define TRACE_BLOCK(half)                                                                  \
  ((half) == MOECOMM_TRACE_DISPATCH_RECV || (half) == MOECOMM_TRACE_COMBINE_RECV ? gridDim.x - 1 : 0)
#define TRACE(half, point)                                                                 \
  do {                                                                                     \
    if (threadIdx.x == 0 && blockIdx.x == TRACE_BLOCK(half))                               \
      moecomm_trace[(half) * MOECOMM_TRACE_POINTS + (point)] = clock64();                  \
  } while (0)
#define TRACE_LAST_START() const long long trace_start = clock64()
#define TRACE_LAST(half)                                                                   \
  do {                                                                                     \
    if (threadIdx.x == 0)                                                                  \
      moecomm_trace[((half) + 1) * MOECOMM_TRACE_POINTS - 1] = clock64() - trace_start;    \
  } while (0)
#else
#define TRACE(half, point)
#define TRACE_SPAN(half, at)
#define TRACE_LAST_START()
#define TRACE_LAST(half)
#endif

namespace moecomm {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {  // a word only this GPU writes
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A store other threads of the system may poll (ordered after earlier writes by a fence before it).
__device__ __forceinline__ void store_relaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int load_volatile(const int* p) { return *(const volatile int*)p; }

// Order this thread's earlier writes, and those it has observed (through a block barrier: the fence is
// cumulative), before its later writes, for every observer in the system (peers over NVLink, the host).
// Lighter than __threadfence_system (fence.sc.sys), and all a release needs.
__device__ __forceinline__ void fence_system() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// The first statement of every kernel moecomm/_abi.py marks dependent: such a kernel is a programmatic dependent
// launch on Hopper and later (moecomm/_cuda.py: Launch), which may start while the stream's previous kernel still
// runs. It waits here for that kernel to end, its writes visible, before anything touches memory, then lets the
// stream's next kernel launch, whose blocks become resident as this one's leave and wait the same way: the launch
// and block scheduling of a kernel overlap the end of the one before it. Launched otherwise, both pass at once.
__device__ __forceinline__ void after_previous_kernel() {
#if __CUDA_ARCH__ >= MOECOMM_PROGRAMMATIC_ARCH
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Error word: int32[MOECOMM_ERROR_WORDS] = {code, peer, phase, detail, call, amount}. The first error
// recorded wins, except that a timeout replaces an error of another kind (it is the one that breaks the
// communicator, so the host must see it) and an error of a later call replaces one of an earlier call (the
// host raises a call's first error as soon as it sees it, while the call's last kernel may still record a
// consequence of it: such a leftover must not hide the next call's error).
__device__ __forceinline__ void record_error(int* err, int code, int peer, int phase, int detail, int call,
                                             int amount = 0) {
  int old = atomicCAS(err, MOECOMM_ERR_NONE, code);
  if (old != MOECOMM_ERR_NONE && old != MOECOMM_ERR_TIMEOUT &&
      (code == MOECOMM_ERR_TIMEOUT || load_volatile(&err[4]) < call))
    old = atomicCAS(err, old, code) == old ? MOECOMM_ERR_NONE : old;
  if (old == MOECOMM_ERR_NONE) {
    err[1] = peer;
    err[2] = phase;
    err[3] = detail;
    err[4] = call;
    err[5] = amount;
    __threadfence_system();
  }
}

// The bound of every wait loop: call it once per spin (spin counting from 1, the loop's own counter, which it
// marks). True when the wait must stop: another thread has recorded a timeout (so one failure stops every
// waiter), `peer` has left the job (its word in `gone`, the transport's [world] departure words, set by that
// rank as it goes: a timeout naming it with detail MOECOMM_TIMEOUT_LEFT is recorded), or the deadline has passed
// (a timeout naming `peer` is recorded). The clock, the error word (possibly in mapped host memory) and the
// departure word are read once per POLL_CHECK spins. A departure counts only when it is seen at two checks in a
// row (the first marks `spin` with SEEN_GONE): a peer that sent what is awaited and then left is not taken for
// one that left first, since the loop reads the awaited word again (POLL_CHECK times) after the departure word.
constexpr unsigned POLL_CHECK = 256;
constexpr unsigned SEEN_GONE = 1u << 31;
__device__ __forceinline__ bool give_up(unsigned& spin, uint64_t deadline_ns, int* err, const uint64_t* gone, int peer,
                                        int phase, int call) {
  if (spin % POLL_CHECK) return false;
  if (load_volatile(err) == MOECOMM_ERR_TIMEOUT) return true;
  if (load_acquire(&gone[peer])) {
    if (!(spin & SEEN_GONE)) {
      spin |= SEEN_GONE;
      return false;
    }
    record_error(err, MOECOMM_ERR_TIMEOUT, peer, phase, MOECOMM_TIMEOUT_LEFT, call);
    return true;
  }
  if (now_ns() <= deadline_ns) return false;
  record_error(err, MOECOMM_ERR_TIMEOUT, peer, phase, 0, call);
  return true;
}

// Spin until *sig >= expected. Returns false when the wait gives up (give_up).
__device__ __forceinline__ bool wait_geq(const uint64_t* sig, uint64_t expected, uint64_t deadline_ns,
                                         int* err, const uint64_t* gone, int peer, int phase, int call) {
  for (unsigned spin = 1; load_acquire(sig) < expected; ++spin)
    if (give_up(spin, deadline_ns, err, gone, peer, phase, call)) return false;
  return true;
}

}  // namespace moecomm
