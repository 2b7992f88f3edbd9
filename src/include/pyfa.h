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
 * Tensors are float32:
 *   q, o, dq, do       (B, H, Nq, d)
 *   k, v, dk, dv       (B, Hkv, Nk, d)
 *   lse, m, l          (B, H, Nq), always dense (row-major)
 * with B = batch, H = heads, Hkv = heads_kv, Nq = seqlen_q, Nk = seqlen_k, d = head_dim
 * (packed sequences, pyfa_problem.varlen: (total, heads, d) and (H, total_q) instead).
 * The 4-D tensors are addressed through the element strides in pyfa_problem (dense
 * row-major when left zero): element (b, h, n, x) of q is at q[b * problem->q.batch +
 * h * problem->q.head + n * problem->q.row + x]. The last dimension is always contiguous.
 * Outputs must not overlap each other, nor any input where they are written in place
 * (PYFA_FLAG_IN_PLACE, device pointers); such a call is PYFA_ERROR_INVALID_ARGUMENT
 * naming both tensors. Each tensor's bytes are found from its pointer, shape and
 * strides: two tensors with the same strides (views of one array, packed ones such as
 * (B, N, 3, H, d) included) are compared element by element, exactly; two with
 * different strides are taken to overlap when the spans from their first to their last
 * byte intersect, even if their elements interleave without meeting.
 * Query head h reads K/V head h / (H / Hkv) (grouped-query and multi-query attention);
 * dK and dV of a K/V head sum over its group's query heads in a fixed order.
 *
 * Masks: key j is visible to query row i iff i + off - left <= j <= i + off + right,
 * with off = Nk - Nq (PYFA_ALIGN_BOTTOM_RIGHT) or 0 (PYFA_ALIGN_TOP_LEFT), plus
 * problem->diagonal_offset (ABI 8, 0 by default); left and
 * right come from the window (unbounded without one) and causal sets right = 0. A row
 * that sees no key gets O = 0 and LSE = -inf (FA1: m = -inf, l = 0).
 *
 * Evolution: pyfa_problem, pyfa_config and pyfa_tensors start with struct_size, the size
 * of the layout the caller compiled: sizeof, or 0 for the struct's first layout (ABI 3's
 * for pyfa_problem and pyfa_config, which ended at variant; ABI 5's for pyfa_tensors).
 * The library accepts exactly the sizes of the layouts published so far (pyfa_problem:
 * ABI 3's, which is also ABI 4's and 5's, ABI 6's, ABI 7's, ABI 8's, which is also
 * ABI 9's, ABI 10's and ABI 11's, which is also ABI 12's; pyfa_config: ABI 3's and
 * ABI 4's, which is also ABI 5's to 12's; pyfa_tensors: ABI 5's, ABI 6's, which is also
 * ABI 7's and 8's, ABI 9's, ABI 10's, which is also ABI 11's, and ABI 12's)
 * and copies that many
 * bytes into a zeroed
 * struct of its own, so a caller of an older layout gets zero for every later field,
 * and every zero means "as before"; a caller that sets a later field (pyfa_config.flags)
 * passes sizeof. Any other struct_size, one that would end inside a field or one larger
 * than the library's (a newer header's: fields this library does not have), is
 * PYFA_ERROR_INVALID_ARGUMENT naming problem->struct_size, config->struct_size or
 * tensors->struct_size, and no byte beyond the library's own struct is read.
 * A later ABI adds an input (bias, dropout seed, cu_seqlens, a page table, ...) as a
 * field at the end of these structs, never as a new entry point: a tensor becomes a
 * pyfa_tensor of pyfa_tensors, a setting a field of pyfa_config or pyfa_problem, each
 * starting at or after the previous layout's sizeof (never in its tail padding) and
 * zero meaning its absence; the new sizeof joins the accepted sizes and
 * PYFA_ABI_VERSION is bumped.
 *
 * The text between PYFA_CDEF_BEGIN and PYFA_CDEF_END is also read by the Python loader
 * (cffi, ABI mode), so it holds declarations only: no preprocessor lines.
 */
#ifndef PYFA_H
#define PYFA_H

#include <stddef.h>
#include <stdint.h>

/* Bumped whenever a declaration between PYFA_CDEF_BEGIN and PYFA_CDEF_END changes. */
#define PYFA_ABI_VERSION 12

/* PYFA_API marks the exported functions; pyfa_export.h is generated by CMake
   (GenerateExportHeader) and installed beside this header. */
#include "pyfa_export.h"

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
    PYFA_ERROR_CANCELLED = 8,           /* config->progress asked to stop; nothing was written */
    /* ---- strict emulator (PYFA_FLAG_EMU_STRICT) */
    PYFA_ERROR_KERNEL_HAZARD = 9        /* strict mode found a race, async, init, bounds, align or
                                           barrier hazard in a kernel; the message names the kernel,
                                           the check, the buffer and element, the threads and the
                                           site; nothing was written */
} pyfa_status;

typedef enum pyfa_backend {
    PYFA_BACKEND_AUTO = 0, /* host entry points: CUDA when usable, else the cpu backend;
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

/* Each operation of the library: what pyfa_run runs, and which kernels it launches
   (FA2 backward: preprocess, dK/dV, dQ; the others one kernel each). */
typedef enum pyfa_op {
    PYFA_OP_FA2_FORWARD = 0,   /* q, k, v -> o, lse */
    PYFA_OP_FA2_BACKWARD = 1,  /* q, k, v, o, lse, dout -> dq, dk, dv */
    PYFA_OP_FA1_FORWARD = 2,   /* q, k, v -> o, m, l */
    PYFA_OP_FA1_BACKWARD = 3   /* q, k, v, o, m, l, dout -> dq, dk, dv */
} pyfa_op;

/* Element strides of one (B, heads, N, d) tensor. All three 0: dense row-major, i.e.
   (heads * N * d, N * d, d). Otherwise each must be >= 0 (any values: views into a
   larger or packed array, e.g. flash-attn's (B, N, H, d) is (N*H*d, d, H*d)). */
typedef struct pyfa_strides {
    int64_t batch;  /* elements from batch b to b+1 */
    int64_t head;   /* elements from head h to h+1 */
    int64_t row;    /* elements from row n to n+1; the last dimension (d) is contiguous */
} pyfa_strides;

/* Where the causal diagonal (and the window's centre) sits when Nq != Nk. */
typedef enum pyfa_causal_align {
    PYFA_ALIGN_BOTTOM_RIGHT = 0, /* off = Nk - Nq: flash-attn's, pyfa's before ABI 3 */
    PYFA_ALIGN_TOP_LEFT = 1      /* off = 0: PyTorch's is_causal */
} pyfa_causal_align;

/* Which kernels run. */
typedef enum pyfa_variant {
    PYFA_VARIANT_AUTO = 0,       /* fast where it applies, else reference */
    PYFA_VARIANT_REFERENCE = 1,  /* the readable kernels */
    PYFA_VARIANT_FAST = 2        /* register-tiled kernels; an error where they do not apply */
} pyfa_variant;

typedef struct pyfa_problem {
    uint32_t struct_size;  /* sizeof(pyfa_problem) as the caller compiled it; 0 means ABI 3's layout */
    int64_t batch;         /* B >= 1 */
    int64_t heads;         /* H >= 1, query heads */
    int64_t seqlen_q;      /* Nq >= 1 */
    int64_t seqlen_k;      /* Nk >= 1 */
    int64_t head_dim;      /* d in [1, 256] */
    float scale;           /* softmax scale; 0 means 1/sqrt(d) */
    int causal;            /* nonzero: window_right is 0 (with or without a window) */
    int64_t heads_kv;      /* Hkv: K/V heads, heads % heads_kv == 0; 0 means heads */
    int window;            /* nonzero: window_left and window_right apply; 0: unbounded both */
    int64_t window_left;   /* keys visible left of the diagonal; < 0 unbounded */
    int64_t window_right;  /* keys visible right of the diagonal; < 0 unbounded */
    int causal_align;      /* a pyfa_causal_align; where the diagonal sits */
    /* Element strides of each 4-D tensor; all zero: dense. Those of tensors an entry
       point does not take are ignored. */
    pyfa_strides q, k, v, o, dout, dq, dk, dv;
    /* ---- Packed sequences (varlen, flash-attn's cu_seqlens), read only when struct_size
       reaches past them; 0: a dense batch. Nonzero: the batch is `batch` sequences packed
       along the rows, with their offsets in pyfa_run's tensors->cu_seqlens_q and
       cu_seqlens_k (so only pyfa_run takes them). Then
         q, o, dout, dq   (total_q, H, d): element (n, h, x) at n * strides.row + h * strides.head + x
         k, v, dk, dv     (total_k, Hkv, d), likewise
         lse, m, l        (H, total_q), dense
       (all-zero strides: dense (total, heads, d), i.e. row = heads * d, head = d; the
       batch strides are not used), and sequence b owns query rows cu_seqlens_q[b] ..
       cu_seqlens_q[b + 1] - 1 and key rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1.
       seqlen_q and seqlen_k are then the longest query and key lengths (bounds: a larger
       value is allowed and sizes the grid), each >= 1. Each sequence is its own problem:
       its mask's off is its Nk_b - Nq_b (bottom-right) or 0, a tile never straddles two
       sequences, a sequence may be empty (Nq_b = 0: nothing; Nk_b = 0: its rows get
       O = 0, LSE = -inf), and its rows' bits equal those of the dense call of that
       sequence alone. A bias is then (batch, H, seqlen_q, seqlen_k) at bias_strides,
       sequence b adding bias[b, h, i, j] for its own rows i and keys j (the corner of its
       lengths); dBias likewise, +0 beyond each sequence's corner. */
    int varlen;            /* nonzero: packed sequences, as above */
    int64_t total_q;       /* rows of q, o, dout, dq: cu_seqlens_q[batch], >= 1 */
    int64_t total_k;       /* rows of k, v, dk, dv: cu_seqlens_k[batch], >= 1 */
    /* Dropout of the attention probabilities in P V (docs/numerics.md, "Dropout"): each
       element kept with probability 1 - dropout_p and then scaled by 1 / (1 - dropout_p),
       by a Philox4x32-10 decision that is a pure function of (dropout_seed,
       dropout_offset, b, h, i, j); LSE (FA1: m, l) is that of the undropped P, and the
       backward regenerates the same decisions. dropout_p in [0, 1); 0 is off. */
    float dropout_p;
    uint64_t dropout_seed;
    uint64_t dropout_offset;
    /* Additive bias (issue 27), read only when tensors->bias is given: element strides of
       the (B, H, Nq, Nk) float32 bias, whose keys (the last axis) are contiguous. Taken as
       they are: a stride of 0 broadcasts the bias along its axis (all three 0: one row of
       Nk values for every b, h, i), so a dense bias spells out (H * Nq * Nk, Nq * Nk, Nk).
       Each must be >= 0. */
    pyfa_strides bias_strides;
    /* ---- softcap (read only when struct_size reaches past it) */
    float softcap;         /* > 0: each scaled score s becomes softcap * tanh(s / softcap), before
                              the mask (Gemma 2's logit soft-capping); 0: off */
    /* ---- Split-KV (flash-decoding with a fixed split size), read only when struct_size
       reaches past it; 0: one chunk. FA2 forward and backward only (other ops refuse it).
       Forward: keys are processed in chunks of split_size (a positive multiple of the
       forward kernel's Bc): each chunk yields a partial (O, LSE) in scratch, folded in
       ascending chunk order (docs/numerics.md, "Split-KV"). A row's bits then depend on
       its q row, its visible keys in order and split_size, never on Nq, the batch or the
       chunk count. Backward (a multiple of the dQ kernel's Bc and the dK/dV kernel's Br;
       not with tensors->dbias): dQ summed per key chunk and dK, dV per query chunk of
       split_size, folded in ascending chunk order (docs/numerics.md, "FA2 backward"). */
    int64_t split_size;    /* keys (backward: keys and queries) per chunk; 0: no split */
    /* ---- (ABI 8, read only when struct_size reaches past it) The call as a block of a
       larger problem: query row i and key j of this call are rows P + i and K + j there,
       diagonal_offset = P - K (context parallelism computes such blocks, one per rank
       and key chunk). It is added to the mask's off (causal_align's), so causal, window
       and ALiBi's distance |i + off - j| move with it; dropout's (b, h, i, j) do not
       (dropout_origin, ABI 11, moves them). |diagonal_offset| <= 2^40. */
    int64_t diagonal_offset;
    /* ---- (ABI 10, read only when struct_size reaches past it) Paged K/V (vLLM's and
       flash-attn's block tables); 0: not paged. With varlen and tensors->block_table,
       forwards only: the packed key rows r = cu_seqlens_k[b] + n above are logical, and
       row r lies at row block_table[r / page_size] * page_size + r % page_size of k and
       v, which hold num_pages * page_size rows (their strides as above). So flash-attn's
       row-major (B, max_pages) table is this one with cu_seqlens_k[b] = b * max_pages *
       page_size and tensors->seqused_k the cache lengths: each cu_seqlens_k[b] must be a
       multiple of page_size, total_k is the logical rows, and the pages a sequence uses
       must lie in [0, num_pages) (checked where the library can read the table, as the
       offsets are); they may repeat (shared prefixes) and come in any order. */
    int64_t page_size;     /* rows per page, >= 1; 0: not paged */
    int64_t num_pages;     /* pages of k and v, >= 1 when paged */
    /* ---- (ABI 11, read only when struct_size reaches past it) Dropout's origin: element
       (b, h, i, j) of this call draws the keep decision of element (b, h, i, j) +
       dropout_origin of a larger problem, i.e. dropout_origin = (B0, H0, P, K) for a call
       on batch elements B0.., query heads H0.., query rows P.. and keys K.. of it (context
       parallelism: a rank's block of rows and keys; Ulysses: its first head; a batch
       split into calls). Independent of diagonal_offset, which moves the mask only. Each
       >= 0; with dropout, origin + extent within dropout's counters: B0 + B and H0 + H at
       most 2^32, P + Nq at most 2^32, K + Nk at most 2^34. All 0: the call's own (b, h, i, j). */
    int64_t dropout_origin[4];
} pyfa_problem;

typedef enum pyfa_flags {
    PYFA_FLAG_IN_PLACE = 1,
    /* ---- strict emulator: the emulator checks every shared and global access of its
       kernels (docs/emulator.md, "Strict mode") and fails the call with
       PYFA_ERROR_KERNEL_HAZARD at the first hazard; the environment variable
       PYFA_EMU_CHECK=strict sets it for every call. Used by the emulator only. */
    PYFA_FLAG_EMU_STRICT = 2
} pyfa_flags;

typedef struct pyfa_config {
    uint32_t struct_size; /* sizeof(pyfa_config) as the caller compiled it; 0 means ABI 3's layout */
    int backend;       /* a pyfa_backend */
    int block_r;       /* Br, rows of Q per tile; 0 means the kernel's default */
    int block_c;       /* Bc, rows of K and V per tile; 0 means the kernel's default */
    int emu_order;     /* a pyfa_emu_order; used by the emulator only */
    uint64_t emu_seed; /* seed of PYFA_EMU_ORDER_SHUFFLED */
    int emu_workers;   /* OS threads the emulator spreads blocks over, at most 256; 0 means one per core */
    int threads;       /* OS threads of the cpu backend, at most 256 (more is PYFA_ERROR_INVALID_ARGUMENT);
                          0 means one per core, fewer on calls too small to gain from them.
                          Results never depend on it */
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
    int variant;         /* a pyfa_variant: which kernels run (AUTO: the fast ones where
                            they apply); PYFA_VARIANT_FAST where they do not is
                            PYFA_ERROR_INVALID_ARGUMENT naming what they lack */
    /* Since ABI 4, read only when struct_size reaches past it: pyfa_flags bits, 0 for
       none. PYFA_FLAG_IN_PLACE: the host backends (cpu, emu) write the caller's outputs
       directly instead of staging them in buffers of their own that are copied over once
       the call has succeeded (the cpu backend only dense outputs, the ones it
       addresses). Peak memory drops by the outputs' size and the copies' time is saved,
       but a call that fails after it started (cancelled by progress, an emulated
       kernel's fault) may leave the outputs partly written: for outputs that are the
       caller's scratch until the call succeeds. Ignored by CUDA. */
    uint64_t flags;
} pyfa_config;

/* Where the tensors of a pyfa_run call live. */
typedef enum pyfa_memory {
    PYFA_MEMORY_HOST = 0,   /* host pointers: the call behaves as the host entry points */
    PYFA_MEMORY_DEVICE = 1  /* device pointers (host pointers for the emulator and the cpu
                               backend): the call behaves as the *_device entry points */
} pyfa_memory;

/* One float32 tensor of a pyfa_run call (int32 for cu_seqlens_q and cu_seqlens_k). */
typedef struct pyfa_tensor {
    void* data;            /* NULL: absent */
    pyfa_strides strides;  /* element strides of a 4-D tensor, all 0: those in pyfa_problem
                              (dense when those are 0 too); must be 0 for lse, m, l and
                              cu_seqlens_q, cu_seqlens_k */
} pyfa_tensor;

/* The tensors of a pyfa_run call, by name; shapes as at the top of this file. A tensor
   the op takes must be given, a float tensor's data aligned to a float
   (PYFA_ERROR_INVALID_ARGUMENT naming it otherwise), and one it does not take must be
   left absent. */
typedef struct pyfa_tensors {
    uint32_t struct_size;  /* sizeof(pyfa_tensors) as the caller compiled it; 0 means ABI 5's layout */
    int memory;            /* a pyfa_memory */
    pyfa_tensor q, k, v;   /* inputs of every op */
    pyfa_tensor o;         /* output of the forwards, input of the backwards */
    pyfa_tensor lse;       /* FA2: output of the forward, input of the backward */
    pyfa_tensor m, l;      /* FA1: outputs of the forward, inputs of the backward */
    pyfa_tensor dout;      /* dO, input of the backwards (errors call it "do" in the entry points below) */
    pyfa_tensor dq, dk, dv; /* outputs of the backwards */
    /* ---- Packed sequences (problem->varlen nonzero), inputs of every op; read only when
       struct_size reaches past them. int32, (batch + 1) offsets each: first 0, monotone
       non-decreasing, last total_q (total_k), every length at most seqlen_q (seqlen_k).
       Where the library can read them (host memory: tensors->memory PYFA_MEMORY_HOST, or
       the cpu and emu backends) it checks all of that first (PYFA_ERROR_INVALID_ARGUMENT
       naming the offset); device pointers on CUDA are not read by the host, and offsets
       breaking these rules there give undefined results. Given without problem->varlen,
       or absent with it: PYFA_ERROR_INVALID_ARGUMENT. */
    pyfa_tensor cu_seqlens_q;
    pyfa_tensor cu_seqlens_k;
    /* Additive bias (issue 27): S = scale * q . k + bias[b, h, i, j] before the mask.
       -inf is allowed: exp gives that score P = 0 exactly, so a row whose keys are all -inf
       gets O = 0 and LSE = -inf (FA1: m = -inf, l = 0) like a row with no visible key; a
       NaN is a NaN score. Its strides are problem->bias_strides (these must be 0). */
    pyfa_tensor bias;   /* optional input of every op; the backwards need the forward's */
    /* Optional output of the backwards (needs bias): dBias, dense in the bias's shape
       (B or 1, H or 1, Nq or 1, Nk), 1 along each axis whose problem->bias_strides is 0:
       dS summed over the axes the bias broadcasts in one fixed order (docs/numerics.md
       §2). Strides must be 0. Not with PYFA_VARIANT_FAST (the fast dK/dV and FA1 backward
       kernels do not write it). */
    pyfa_tensor dbias;
    /* ---- ALiBi (read only when struct_size reaches past it); an input of every op.
       NULL: off. Else each scaled score (after softcap) becomes
       S - slope[b, h] * |i + off - j|, off = Nk - Nq (PYFA_ALIGN_BOTTOM_RIGHT; with packed
       sequences each sequence's own lengths) or 0 (PYFA_ALIGN_TOP_LEFT),
       slope[b, h] = data[b * strides.batch + h * strides.head]:
       strides all 0 means a dense (B, H) array, (0, 1, 0) an (H,) one shared by every
       batch element; strides.row must be 0. Finite slopes are the caller's to give. */
    pyfa_tensor alibi_slopes;
    /* ---- (ABI 9, read only when struct_size reaches past it) Keys in use per packed
       sequence (flash-attn's seqused_k): NULL, or int32 (batch,) with problem->varlen, an
       input of the forwards only. Sequence b then attends to its first seqused_k[b] keys,
       rows cu_seqlens_k[b] .. cu_seqlens_k[b] + seqused_k[b] - 1, its mask aligned to that
       length; each value in [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]] (checked where the
       library can read it, as the offsets are; each is then bounded by problem->seqlen_k
       instead of the offsets' lengths). So a dense KV cache (B, Nmax, Hkv, d) is
       read in place as packed sequences with cu_seqlens_k = b * Nmax and seqused_k its
       cache lengths. Strides must be 0. */
    pyfa_tensor seqused_k;
    /* ---- (ABI 10, read only when struct_size reaches past it) The page table of paged
       K/V (problem->page_size): int32 (total_k / page_size,), entry p the page of k and v
       holding logical key rows p * page_size .. (p + 1) * page_size - 1. Given exactly
       when problem->page_size is nonzero; strides must be 0. Entries past a sequence's
       keys in use are never read. */
    pyfa_tensor block_table;
    /* ---- (ABI 12, read only when struct_size reaches past it) Attention sinks (gpt-oss's
       learned sinks), an input of pyfa_fa2_forward only: NULL, or float32 (heads,), one
       logit s_h per query head that joins the softmax of every row of head h and carries
       no value. Each row's final state (O, LSE) is merged with the state (0, s_h) of an
       empty key set by the split-KV combine's rule (docs/numerics.md, "Attention sinks"),
       after the split chunks where problem->split_size splits: O' = O exp(LSE - LSE'),
       LSE' = log(exp(LSE) + exp(s_h)); a row that sees no key gets O = 0, LSE = s_h. -inf
       is no sink for that head (its rows keep their bits); finite values or -inf are the
       caller's to give (NaN or +inf give NaN rows). The backward of (q, k, v) takes the
       merged (O', LSE') as its o and lse and needs no sinks. Strides must be 0. */
    pyfa_tensor sinks;
} pyfa_tensors;

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
   unknown kernel (anything but a pyfa_kernel), an argument below 1, or a size beyond
   INT64_MAX. */
PYFA_API int64_t pyfa_smem_bytes(int kernel, int block_r, int block_c, int64_t head_dim);
/* Tiles the kernel uses when pyfa_config asks for 0, for this head_dim on this backend. */
PYFA_API pyfa_status pyfa_default_tiles(int kernel, int64_t head_dim, int backend,
                                        int* block_r, int* block_c);
/* The same for one variant (a pyfa_variant): PYFA_VARIANT_FAST the register-tiled
   kernel's (PYFA_ERROR_INVALID_ARGUMENT naming what it lacks where it has none for this
   kernel, head_dim or tiles, or where the backend named has kernels of its own: the cpu
   backend), PYFA_VARIANT_AUTO what a call with variant AUTO and zero
   tiles would run. pyfa_variant_smem_bytes is 0 where the variant has no kernel. */
PYFA_API int64_t pyfa_variant_smem_bytes(int kernel, int variant, int block_r, int block_c,
                                         int64_t head_dim);
PYFA_API pyfa_status pyfa_variant_default_tiles(int kernel, int variant, int64_t head_dim,
                                                int backend, int* block_r, int* block_c);

/* ---- Any op on named tensors: op is a pyfa_op. The one entry point every other one
   below is a thin wrapper of, with the same checks, results and promises: with
   tensors->memory PYFA_MEMORY_HOST as the host entry points (stream must be NULL), with
   PYFA_MEMORY_DEVICE as the *_device ones, enqueued on stream.
   A tensor's strides are given in one place: in its pyfa_tensor, or (all three zero
   there) in pyfa_problem's field of the same name, as the entry points below take them;
   nonzero strides in both that differ are PYFA_ERROR_INVALID_ARGUMENT naming both. ---- */
PYFA_API pyfa_status pyfa_run(int op, const pyfa_problem* problem, const pyfa_config* config,
                              const pyfa_tensors* tensors, void* stream);

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

/* ---- Dropout's keep decisions, for tests and users (flash-attn's return_attn_probs role):
   keep[((b * H + h) * Nq + i) * Nk + j] = 1 where the kernels keep element (b, h, i, j)
   of P under problem's dropout_p, dropout_seed and dropout_offset, 0 where they drop it,
   computed on the host by the function the kernels call. Reads batch, heads, seqlen_q,
   seqlen_k and the dropout fields (dropout_p 0: all 1); keep is dense (B, H, Nq, Nk). ---- */
PYFA_API pyfa_status pyfa_dropout_mask(const pyfa_problem* problem, uint8_t* keep);  /* (B, H, Nq, Nk) */

/* PYFA_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* PYFA_H */
