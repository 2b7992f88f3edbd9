// tiling.h: integer helpers for tile counts, shared by every kernel (pyfa/sim/tiling.py twin).
// Which tiles a kernel visits is the mask's business (common/mask.h).
#pragma once

#include "common/device.h"

PYFA_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
PYFA_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
PYFA_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
