// Device-side delay: the benchmark launches it ahead of a timed region so that the region's kernels are
// already queued when it starts (the host's launch latency stays out of device timings). Built into the
// benchmark's own module (moecomm/_jit.py, VARIANTS), not into a transport's.
#include "device.cuh"

// grid: one block of one thread. Spins until d.ns nanoseconds of the global timer have passed.
extern "C" __global__ void moecomm_delay(const moecomm::Delay d) {
  const uint64_t until = moecomm::now_ns() + d.ns;
  while (moecomm::now_ns() < until) __nanosleep(1000);
}
