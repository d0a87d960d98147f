// The stamps of a MOECOMM_TRACE=1 build (device.cuh), read by tools/trace_kernels.py; empty otherwise.
#include "device.cuh"

#if MOECOMM_TRACE
__device__ unsigned long long moecomm_trace[MOECOMM_TRACE_HALVES * MOECOMM_TRACE_POINTS];
__device__ unsigned long long moecomm_span[MOECOMM_TRACE_HALVES * MOECOMM_TRACE_SPAN];
#endif
