/*
 * pyfa.h: the public C ABI of libpyfa (FlashAttention-1 and -2, fp32, forward and backward).
 *
 * Plain C99 and C++; needs no CUDA header. Every function returns a pyfa_status and
 * never exits, aborts or lets a C++ exception out, also when memory runs out (that is
 * PYFA_ERROR_OUT_OF_MEMORY); on failure pyfa_last_error() holds a message for the
 * calling thread, and nothing the caller owns has been written (for the *_device entry
 * points, see below).
 *
 * The host entry points (pyfa_fa2_forward, ...) take host pointers. On CUDA they copy
 * through the GPU on a non-blocking stream of the library's own (one per device) and
 * wait for that stream alone: they never synchronize the device or the caller's streams.
 * They return once the outputs are in place, and write the outputs only after every
 * kernel has succeeded (only a CUDA failure while the outputs are copied back, such as a
 * lost device, can leave some of them written).
 *
 * The *_device entry points take device pointers and enqueue the kernels on the caller's
 * stream. Before enqueuing anything they check the arguments, the tiles, each kernel's
 * launch configuration against the device and the scratch allocation; a failure there
 * means nothing was enqueued or written. Once the kernels are enqueued they return
 * PYFA_OK without waiting: a fault while the kernels run (a bad pointer, say) is not
 * reported by the call but by later CUDA calls on that stream or context, and the
 * outputs are then undefined. Should the runtime refuse a launch after an earlier kernel
 * of the same call was enqueued (the configuration was checked, so only e.g. a sticky
 * error left by earlier work), the call returns that error and the earlier kernels may
 * write their outputs: for pyfa_fa2_backward_device, dK and dV (its second kernel)
 * without dQ (its third). Scratch is freed stream-ordered (cudaFreeAsync); on a device
 * without memory pools it is cudaMalloc'ed and cudaFree'd, and cudaFree waits for the
 * device's pending work.
 *
 * Tensors are dense, row-major (C-contiguous) float32:
 *   q, o, dq, do       (B, H, Nq, d)
 *   k, v, dk, dv       (B, H, Nk, d)
 *   lse, m, l          (B, H, Nq)
 * with B = batch, H = heads, Nq = seqlen_q, Nk = seqlen_k, d = head_dim.
 *
 * The text between PYFA_CDEF_BEGIN and PYFA_CDEF_END is also read by the Python loader
 * (cffi, ABI mode), so it holds declarations only: no preprocessor lines.
 */
#ifndef PYFA_H
#define PYFA_H

#include <stddef.h>
#include <stdint.h>

/* Bumped whenever a declaration between PYFA_CDEF_BEGIN and PYFA_CDEF_END changes. */
#define PYFA_ABI_VERSION 2

#if defined(_WIN32)
#define PYFA_API __declspec(dllexport)
#else
#define PYFA_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* PYFA_CDEF_BEGIN */

typedef enum pyfa_status {
    PYFA_OK = 0,
    PYFA_ERROR_INVALID_ARGUMENT = 1,    /* an argument is out of range; the message names it */
    PYFA_ERROR_TILE_TOO_LARGE = 2,      /* Br, Bc need more shared memory than the device has */
    PYFA_ERROR_BACKEND_UNAVAILABLE = 3, /* e.g. CUDA asked for, but no GPU or not compiled in */
    PYFA_ERROR_CUDA = 4,                /* a CUDA runtime call failed; the message says which */
    PYFA_ERROR_EMULATION = 5,           /* the emulator found a barrier divergence or deadlock */
    PYFA_ERROR_OUT_OF_MEMORY = 6,
    PYFA_ERROR_INTERNAL = 7,
    PYFA_ERROR_CANCELLED = 8            /* config->progress asked to stop; nothing was written */
} pyfa_status;

typedef enum pyfa_backend {
    PYFA_BACKEND_AUTO = 0, /* host entry points: CUDA when usable, else the emulator;
                              *_device entry points: CUDA, or PYFA_ERROR_BACKEND_UNAVAILABLE */
    PYFA_BACKEND_CUDA = 1,
    PYFA_BACKEND_EMU = 2,  /* the same kernel source run on the CPU, threads as fibers */
    PYFA_BACKEND_CPU = 3   /* native vectorised C++ on the host, bit-identical to the kernels */
} pyfa_backend;

typedef enum pyfa_emu_order {
    PYFA_EMU_ORDER_FORWARD = 0,  /* resume threads 0, 1, ..., n-1 after each barrier */
    PYFA_EMU_ORDER_REVERSE = 1,  /* n-1, ..., 0 */
    PYFA_EMU_ORDER_SHUFFLED = 2  /* a fresh permutation per round, drawn from emu_seed */
} pyfa_emu_order;

/* Each kernel of the library; used to ask for shared-memory sizes and default tiles. */
typedef enum pyfa_kernel {
    PYFA_KERNEL_FA1_FORWARD = 0,
    PYFA_KERNEL_FA2_FORWARD = 1,
    PYFA_KERNEL_FA1_BACKWARD = 2,
    PYFA_KERNEL_FA2_BACKWARD_PREPROCESS = 3, /* D = rowsum(dO o O) */
    PYFA_KERNEL_FA2_BACKWARD_DKDV = 4,       /* column-parallel: dK_j, dV_j */
    PYFA_KERNEL_FA2_BACKWARD_DQ = 5          /* row-parallel: dQ_i, no atomics */
} pyfa_kernel;

typedef struct pyfa_problem {
    int64_t batch;     /* B >= 1 */
    int64_t heads;     /* H >= 1 */
    int64_t seqlen_q;  /* Nq >= 1 */
    int64_t seqlen_k;  /* Nk >= 1 */
    int64_t head_dim;  /* d in [1, 256] */
    float scale;       /* softmax scale; 0 means 1/sqrt(d) */
    int causal;        /* nonzero: key j is masked for query i when j > i + (Nk - Nq) */
} pyfa_problem;

typedef struct pyfa_config {
    int backend;       /* a pyfa_backend */
    int block_r;       /* Br, rows of Q per tile; 0 means the kernel's default */
    int block_c;       /* Bc, rows of K and V per tile; 0 means the kernel's default */
    int emu_order;     /* a pyfa_emu_order; used by the emulator only */
    uint64_t emu_seed; /* seed of PYFA_EMU_ORDER_SHUFFLED */
    int emu_workers;   /* OS threads the emulator spreads blocks over; 0 means one per core */
    int threads;       /* OS threads of the cpu backend; 0 means one per core. Results never depend on it */
    /* Called now and then while a call runs (from one library thread at a time, not
       necessarily the caller's), with the work done so far and the total, in units of
       the backend's choosing. A nonzero return cancels the call: it then returns
       PYFA_ERROR_CANCELLED soon after, and nothing the caller owns has been written.
       NULL: no callback. On CUDA the units are kernels: a host entry point asks before
       each kernel, after waiting for the ones before it, and once more when all are
       done (done == total) before it copies the outputs; a *_device entry point asks
       once, before it enqueues anything (done == 0), since enqueued work cannot be
       taken back. */
    int (*progress)(void* user, int64_t done, int64_t total);
    void* progress_user; /* passed to progress as is */
} pyfa_config;

/* What the kernels are sized against: the GPU's limits, or the emulated device's. */
typedef struct pyfa_device_profile {
    char name[64];
    int64_t smem_per_block;  /* bytes of shared memory one block may opt in to */
    int max_threads_per_block;
    int sm_count;
} pyfa_device_profile;

PYFA_API const char* pyfa_version(void);
/* PYFA_ABI_VERSION of the library: a loader checks it against the header it was built with. */
PYFA_API int pyfa_abi_version(void);
PYFA_API const char* pyfa_status_string(pyfa_status status);
/* The message of the last failed call made by this thread ("" if none). */
PYFA_API const char* pyfa_last_error(void);

/* 1 when the backend can run here (CUDA: compiled in and a GPU present). */
PYFA_API int pyfa_backend_available(int backend);
/* 1 when the backend was compiled into this library (CUDA: built with nvcc). */
PYFA_API int pyfa_backend_compiled(int backend);
/* Why the backend cannot run here ("" when it can). For CUDA compiled in but not
   usable: the error name and string the runtime gave when it was initialised (decided
   once per process). The string stays valid for the life of the library. */
PYFA_API const char* pyfa_backend_reason(int backend);
PYFA_API pyfa_status pyfa_device_profile_get(int backend, pyfa_device_profile* profile);

/* Bytes of dynamic shared memory the kernel needs for these tiles, exactly; 0 for an
   unknown kernel, an argument below 1, or a size beyond INT64_MAX. */
PYFA_API int64_t pyfa_smem_bytes(int kernel, int block_r, int block_c, int64_t head_dim);
/* Tiles the kernel uses when pyfa_config asks for 0, for this head_dim on this backend. */
PYFA_API pyfa_status pyfa_default_tiles(int kernel, int64_t head_dim, int backend,
                                        int* block_r, int* block_c);

/* ---- FlashAttention-2 forward: O and LSE = m + log(l) per query row. ---- */
PYFA_API pyfa_status pyfa_fa2_forward(const pyfa_problem* problem, const pyfa_config* config,
                                      const float* q,  /* (B, H, Nq, d) */
                                      const float* k,  /* (B, H, Nk, d) */
                                      const float* v,  /* (B, H, Nk, d) */
                                      float* o,        /* (B, H, Nq, d) */
                                      float* lse);     /* (B, H, Nq) */
/* Same on device pointers, enqueued on stream (a cudaStream_t, NULL for the default
   stream); see the top of this file for what it promises. With PYFA_BACKEND_EMU the
   pointers are host pointers and the call behaves as the host entry point. */
PYFA_API pyfa_status pyfa_fa2_forward_device(const pyfa_problem* problem, const pyfa_config* config,
                                             const float* q, const float* k, const float* v,
                                             float* o, float* lse, void* stream);

/* ---- FlashAttention-2 backward: dQ, dK, dV of O = softmax(scale * Q K^T) V, from the
   forward's O and LSE and the incoming gradient dO. Deterministic: no atomics, every sum
   in a fixed order. Three kernels (D = rowsum(dO o O); dK, dV; dQ) and one scratch
   tensor D of (B, H, Nq) floats, allocated and freed by the call. ---- */
PYFA_API pyfa_status pyfa_fa2_backward(const pyfa_problem* problem, const pyfa_config* config,
                                       const float* q,     /* (B, H, Nq, d) */
                                       const float* k,     /* (B, H, Nk, d) */
                                       const float* v,     /* (B, H, Nk, d) */
                                       const float* o,     /* (B, H, Nq, d) from the forward */
                                       const float* lse,   /* (B, H, Nq) from the forward */
                                       const float* dout,  /* (B, H, Nq, d) dO; errors call it "do" */
                                       float* dq,          /* (B, H, Nq, d) */
                                       float* dk,          /* (B, H, Nk, d) */
                                       float* dv);         /* (B, H, Nk, d) */
/* Same on device pointers (host pointers for the emulator), enqueued on stream. */
PYFA_API pyfa_status pyfa_fa2_backward_device(const pyfa_problem* problem, const pyfa_config* config,
                                              const float* q, const float* k, const float* v,
                                              const float* o, const float* lse, const float* dout,
                                              float* dq, float* dk, float* dv, void* stream);

/* ---- FlashAttention-1 forward (Dao et al. 2022, Algorithm 1, as written): K/V tiles in
   the outer loop, Q tiles in the inner loop, one block per (batch, head). O, m and l live
   in HBM and are read and written back at every step; they are returned as the paper
   keeps them: m the row max, l = sum exp(scale * q k - m) (m = -inf, l = 0, O = 0 for a
   row with no visible key). ---- */
PYFA_API pyfa_status pyfa_fa1_forward(const pyfa_problem* problem, const pyfa_config* config,
                                      const float* q,  /* (B, H, Nq, d) */
                                      const float* k,  /* (B, H, Nk, d) */
                                      const float* v,  /* (B, H, Nk, d) */
                                      float* o,        /* (B, H, Nq, d) */
                                      float* m,        /* (B, H, Nq) */
                                      float* l);       /* (B, H, Nq) */
/* Same on device pointers (host pointers for the emulator), enqueued on stream. */
PYFA_API pyfa_status pyfa_fa1_forward_device(const pyfa_problem* problem, const pyfa_config* config,
                                             const float* q, const float* k, const float* v,
                                             float* o, float* m, float* l, void* stream);

/* ---- FlashAttention-1 backward (Dao et al. 2022, Algorithm 4): dQ, dK, dV from the
   forward's O, m, l and the incoming gradient dO. K/V tiles outer, Q tiles inner, one
   block per (batch, head); dQ is accumulated in HBM. Deterministic: no atomics. ---- */
PYFA_API pyfa_status pyfa_fa1_backward(const pyfa_problem* problem, const pyfa_config* config,
                                       const float* q,     /* (B, H, Nq, d) */
                                       const float* k,     /* (B, H, Nk, d) */
                                       const float* v,     /* (B, H, Nk, d) */
                                       const float* o,     /* (B, H, Nq, d) from the forward */
                                       const float* m,     /* (B, H, Nq) from the forward */
                                       const float* l,     /* (B, H, Nq) from the forward */
                                       const float* dout,  /* (B, H, Nq, d) dO; errors call it "do" */
                                       float* dq,          /* (B, H, Nq, d) */
                                       float* dk,          /* (B, H, Nk, d) */
                                       float* dv);         /* (B, H, Nk, d) */
/* Same on device pointers (host pointers for the emulator), enqueued on stream. */
PYFA_API pyfa_status pyfa_fa1_backward_device(const pyfa_problem* problem, const pyfa_config* config,
                                              const float* q, const float* k, const float* v,
                                              const float* o, const float* m, const float* l,
                                              const float* dout, float* dq, float* dk, float* dv,
                                              void* stream);

/* PYFA_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* PYFA_H */
