"""The steps of tools/device_check.sh, one module per subcommand of tools/gpu_bench.py.

    common     what the steps share: deadlines, JSON files, tools on the PATH, FLOPs, peaks
    info       GPU, driver, nvcc, torch, ncu and compute-sanitizer versions
    bench      every op's device entry point timed with CUDA events, beside PyTorch's SDPA
    drive      runs ops once through the Python API (the program the tools below watch)
    sanitize   compute-sanitizer memcheck and racecheck over `drive`
    ncu        DRAM bytes per kernel (ncu) beside pyfa.sim.count_io
    summary    merges the steps' JSON into summary.json and summary.md

What runs is pyfa.api.OPS, the library's table of operations (C function, inputs and
outputs in C order with their shapes, kernels launched): nothing is parsed or guessed.
"""
