// The IPC transport's heap table (declared in transport_ipc.cuh), built into its module only. The host
// writes it at load time (moecomm/transport/ipc.py) through cuModuleGetGlobal.
#include "transport.cuh"

extern "C" {
__device__ unsigned long long moecomm_ipc_heap[MOECOMM_IPC_MAX_RANKS];
__device__ int moecomm_ipc_rank;
}
