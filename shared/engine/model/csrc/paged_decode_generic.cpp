// The paged decode kernel compiled for the build's default target: runs on any CPU.
#include "paged_decode_params.h"

// 128-bit vectors: what every x86-64 (SSE2) and AArch64 (NEON) CPU has.
#define PD_LANES 4
#if defined(__aarch64__)
#define PD_VECTOR_REGISTERS 32
#else
#define PD_VECTOR_REGISTERS 16
#endif
namespace pdserve::generic {
#include "paged_decode_kernel.h"
}
