// fault.h: compile-time fault hooks for the strict emulator's mutation tests
// (tests/emu/strict_faults.cpp). In every build of the library PYFA_FAULT(name) is the
// constant false and the hooked code is the kernel as written; a build that defines
// PYFA_FAULT_HOOKS (that test's, never the library's) gets a run-time switch per name,
// which breaks the kernel at that one place: a barrier dropped, a wait miscounted, an
// index off by one, an initialisation skipped, a vector access misaligned.
#pragma once

#if defined(PYFA_FAULT_HOOKS)
bool pyfa_fault(const char* name);  // defined by the test
#define PYFA_FAULT(name) pyfa_fault(#name)
#else
#define PYFA_FAULT(name) false
#endif
