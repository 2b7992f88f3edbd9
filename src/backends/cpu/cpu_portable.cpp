// The portable build of the cpu backend's tile code: no instruction-set flags, so GCC
// lowers the 8-float vectors to whatever the target has (SSE2 pairs on x86-64, NEON
// pairs on aarch64, scalars elsewhere). It runs anywhere and gives the same bits.
#define PYFA_CPU_NS portable
#define PYFA_CPU_NAME "portable"
#define PYFA_CPU_W 8
#define PYFA_CPU_RI 1
#define PYFA_CPU_RJ 4
#define PYFA_CPU_TABLE kIsaPortable
#include "backends/cpu/cpu_impl.h"
