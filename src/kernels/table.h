// table.h: every kernel the library launches, one row each. registry.cuh expands the
// function column once per backend; src/core/tiles.cpp expands the rest (names,
// layouts, threads, grids, tile rules, variant selection).
//
// X(ID, NAME, KERNEL, VARIANT, D, BR, BC, FN, LAYOUT, THREADS, GRID)
//   ID       the row's id: the pyfa_kernel id for the readable kernels, 6 and up for the
//            fast ones (never seen outside the library)
//   NAME     for messages and reports
//   KERNEL   the pyfa_kernel it computes; VARIANT PYFA_VARIANT_REFERENCE or _FAST
//   D, BR, BC  the head dim and tiles it is compiled for; 0: any (runtime arguments)
//   FN       the __global__ function (in PYFA_KERNELS)
//            (rows of one kernel, d and tiles differ only in shared memory, e.g. copy stages:
//            the chooser takes the largest that fits the device, src/core/tiles.cpp fast_row)
//   LAYOUT   its shared-memory layout (common/smem.h), a function of (Br, Bc, d)
//   THREADS  threads per block, an expression in Br
//   GRID     kGridQTiles (Tr, H, B) (GQA packed, params.h pack_gqa: (ceil(G*Nq/Br), Hkv, B)),
//            kGridKvTilesKvHeads (Tc, Hkv, B), kGridHeads (1, H, B) or kGridKvHeads (1, Hkv, B)
#pragma once

#define PYFA_KERNEL_TABLE(X)                                                                          \
    X(0, "fa1_forward", PYFA_KERNEL_FA1_FORWARD, PYFA_VARIANT_REFERENCE, 0, 0, 0, fa1_forward_kernel,   \
      fa1_forward_smem, kFa1ForwardThreads, kGridHeads)                                               \
    X(1, "fa2_forward", PYFA_KERNEL_FA2_FORWARD, PYFA_VARIANT_REFERENCE, 0, 0, 0, fa2_forward_kernel,   \
      fa2_forward_smem, kFa2ForwardThreads, kGridQTiles)                                              \
    X(2, "fa1_backward", PYFA_KERNEL_FA1_BACKWARD, PYFA_VARIANT_REFERENCE, 0, 0, 0,                    \
      fa1_backward_kernel, fa1_backward_smem, kFa1BackwardThreads, kGridKvHeads)                        \
    X(3, "fa2_backward_preprocess", PYFA_KERNEL_FA2_BACKWARD_PREPROCESS, PYFA_VARIANT_REFERENCE, 0, 0, \
      0, fa2_backward_preprocess_kernel, fa2_backward_preprocess_smem, kFa2BackwardThreads,           \
      kGridQTiles)                                                                                    \
    X(4, "fa2_backward_dkdv", PYFA_KERNEL_FA2_BACKWARD_DKDV, PYFA_VARIANT_REFERENCE, 0, 0, 0,          \
      fa2_backward_dkdv_kernel, fa2_backward_dkdv_smem, kFa2BackwardThreads, kGridKvTilesKvHeads)            \
    X(5, "fa2_backward_dq", PYFA_KERNEL_FA2_BACKWARD_DQ, PYFA_VARIANT_REFERENCE, 0, 0, 0,              \
      fa2_backward_dq_kernel, fa2_backward_dq_smem, kFa2BackwardThreads, kGridQTiles)                 \
    X(6, "fa2_forward/fast d=64 64x64", PYFA_KERNEL_FA2_FORWARD, PYFA_VARIANT_FAST, 64, 64, 64,        \
      (fa2_forward_fast_kernel<64, 64>), fa2_forward_fast_smem, fa2_forward_fast_threads(Br),        \
      kGridQTiles)                                                                                    \
    X(7, "fa2_forward/fast d=64 128x64", PYFA_KERNEL_FA2_FORWARD, PYFA_VARIANT_FAST, 64, 128, 64,      \
      (fa2_forward_fast_kernel<64, 128>), fa2_forward_fast_smem, fa2_forward_fast_threads(Br),       \
      kGridQTiles)                                                                                    \
    X(8, "fa2_forward/fast d=128 64x64", PYFA_KERNEL_FA2_FORWARD, PYFA_VARIANT_FAST, 128, 64, 64,      \
      (fa2_forward_fast_kernel<128, 64>), fa2_forward_fast_smem, fa2_forward_fast_threads(Br),       \
      kGridQTiles)                                                                                    \
    X(9, "fa2_forward/fast d=128 128x64", PYFA_KERNEL_FA2_FORWARD, PYFA_VARIANT_FAST, 128, 128, 64,    \
      (fa2_forward_fast_kernel<128, 128>), fa2_forward_fast_smem, fa2_forward_fast_threads(Br),      \
      kGridQTiles)                                                                                    \
    X(10, "fa2_backward_dq/fast d=64 64x64", PYFA_KERNEL_FA2_BACKWARD_DQ, PYFA_VARIANT_FAST, 64, 64, 64, \
      (fa2_backward_dq_fast_kernel<64, 64, 1>), fa2_backward_dq_fast_smem,                                \
      fa2_backward_dq_fast_threads(Br), kGridQTiles)                                                  \
    X(11, "fa2_backward_dq/fast d=64 128x64", PYFA_KERNEL_FA2_BACKWARD_DQ, PYFA_VARIANT_FAST, 64, 128,  \
      64, (fa2_backward_dq_fast_kernel<64, 128, 1>), fa2_backward_dq_fast_smem,                           \
      fa2_backward_dq_fast_threads(Br), kGridQTiles)                                                  \
    X(12, "fa2_backward_dq/fast d=128 64x64", PYFA_KERNEL_FA2_BACKWARD_DQ, PYFA_VARIANT_FAST, 128, 64,  \
      64, (fa2_backward_dq_fast_kernel<128, 64, 1>), fa2_backward_dq_fast_roles_smem,                     \
      fa2_backward_dq_fast_roles_threads(Br), kGridQTiles)                                                  \
    X(13, "fa2_backward_dkdv/fast d=64 64x64", PYFA_KERNEL_FA2_BACKWARD_DKDV, PYFA_VARIANT_FAST, 64, 64, \
      64, (fa2_backward_dkdv_fast_kernel<64, 1>), fa2_backward_dkdv_fast_smem,                            \
      fa2_backward_dkdv_fast_threads(Br), kGridKvTilesKvHeads)                                        \
    X(14, "fa1_forward/fast d=64 64x64", PYFA_KERNEL_FA1_FORWARD, PYFA_VARIANT_FAST, 64, 64, 64,      \
      (fa1_forward_fast_kernel<64, 64>), fa1_forward_fast_smem, fa1_forward_fast_threads(Br),         \
      kGridHeads)                                                                                     \
    X(15, "fa1_forward/fast d=64 128x64", PYFA_KERNEL_FA1_FORWARD, PYFA_VARIANT_FAST, 64, 128, 64,    \
      (fa1_forward_fast_kernel<64, 128>), fa1_forward_fast_smem, fa1_forward_fast_threads(Br),        \
      kGridHeads)                                                                                     \
    X(16, "fa1_forward/fast d=128 64x64", PYFA_KERNEL_FA1_FORWARD, PYFA_VARIANT_FAST, 128, 64, 64,    \
      (fa1_forward_fast_kernel<128, 64>), fa1_forward_fast_smem, fa1_forward_fast_threads(Br),        \
      kGridHeads)                                                                                     \
    X(17, "fa1_forward/fast d=128 128x64", PYFA_KERNEL_FA1_FORWARD, PYFA_VARIANT_FAST, 128, 128, 64,  \
      (fa1_forward_fast_kernel<128, 128>), fa1_forward_fast_smem, fa1_forward_fast_threads(Br),       \
      kGridHeads)                                                                                     \
    X(18, "fa1_backward/fast d=64 64x64", PYFA_KERNEL_FA1_BACKWARD, PYFA_VARIANT_FAST, 64, 64, 64,    \
      (fa1_backward_fast_kernel<64>), fa1_backward_fast_smem, fa1_backward_fast_threads(Br),        \
      kGridKvHeads)                                                                                   \
    X(19, "fa1_backward/fast d=128 64x64", PYFA_KERNEL_FA1_BACKWARD, PYFA_VARIANT_FAST, 128, 64, 64,  \
      (fa1_backward_fast_kernel<128>), fa1_backward_fast_smem, fa1_backward_fast_threads(Br),       \
      kGridKvHeads)                                                                                   \
    X(20, "fa2_backward_dkdv/fast d=128 64x64", PYFA_KERNEL_FA2_BACKWARD_DKDV, PYFA_VARIANT_FAST, 128, \
      64, 64, (fa2_backward_dkdv_fast_kernel<128, 1>), fa2_backward_dkdv_fast_smem,                       \
      fa2_backward_dkdv_fast_threads(Br), kGridKvTilesKvHeads)                                        \
    X(21, "fa2_backward_dq/fast d=128 64x64 2 stages", PYFA_KERNEL_FA2_BACKWARD_DQ, PYFA_VARIANT_FAST, 128, \
      64, 64, (fa2_backward_dq_fast_kernel<128, 64, 2>), fa2_backward_dq_fast_roles_smem2,              \
      fa2_backward_dq_fast_roles_threads(Br), kGridQTiles)                                            \
    X(22, "fa2_backward_dkdv/fast d=128 64x64 2 stages", PYFA_KERNEL_FA2_BACKWARD_DKDV, PYFA_VARIANT_FAST, \
      128, 64, 64, (fa2_backward_dkdv_fast_kernel<128, 2>), fa2_backward_dkdv_fast_smem2,              \
      fa2_backward_dkdv_fast_threads(Br), kGridKvTilesKvHeads)

// Rows in the table (ids 0 .. kKernelRows - 1).
constexpr int kKernelRows = 23;
