// device_rules.h: the CUDA backend's decisions that need no GPU to make, as pure functions
// of facts the runtime reports: whether a device can run this library's kernels, and
// which device a *_device call runs on. cuda_backend.cu gathers the facts with the CUDA
// runtime; tests/c/fake_cuda.cpp feeds made-up ones, so the tests exercise these very
// rules without a GPU.
#pragma once

#include <cctype>
#include <cstddef>
#include <cstdio>
#include <cstring>

namespace pyfa {

// One entry of CMAKE_CUDA_ARCHITECTURES ("80", "80-real", "80-virtual", "90a", "100f"):
// which devices its SASS runs on and whether it carries PTX the driver can compile
// for newer ones.
struct BuiltArch {
    int cc;          // 75, 80, 90, 100, 120, ...
    bool sass;       // machine code for cc
    bool ptx;        // PTX for cc, JIT-compiled by the driver for any later device
    char suffix;     // 'a' (this exact device only), 'f' (this family) or 0
};

// Whether `entry` names an architecture; "native", "all" and "all-major" do not (the
// build picked them, and only the kernel-image check can tell).
inline bool parse_built_arch(const char* entry, size_t length, BuiltArch* out) {
    size_t i = 0;
    int cc = 0;
    while (i < length && std::isdigit(static_cast<unsigned char>(entry[i]))) cc = cc * 10 + (entry[i++] - '0');
    if (i == 0 || cc < 10) return false;
    BuiltArch a{cc, true, true, 0};
    if (i < length && (entry[i] == 'a' || entry[i] == 'f')) a.suffix = entry[i++];
    const size_t rest = length - i;
    if (rest == 5 && std::strncmp(entry + i, "-real", 5) == 0)
        a.ptx = false;
    else if (rest == 8 && std::strncmp(entry + i, "-virtual", 8) == 0)
        a.sass = false;
    else if (rest != 0)
        return false;
    *out = a;
    return true;
}

// Whether a device of compute capability major.minor can run kernels built for `built`
// (CMAKE_CUDA_ARCHITECTURES, entries separated by ';', ',' or spaces). *known is false
// when the list names no architecture at all ("native", "all"): then nothing is refused
// here, and the kernel-image check decides.
inline bool arch_supported(const char* built, int major, int minor, bool* known) {
    const int cc = major * 10 + minor;
    *known = false;
    for (const char* p = built; *p;) {
        while (*p == ';' || *p == ',' || *p == ' ') ++p;
        const char* end = p;
        while (*end && *end != ';' && *end != ',' && *end != ' ') ++end;
        BuiltArch a;
        if (end > p && parse_built_arch(p, static_cast<size_t>(end - p), &a)) {
            *known = true;
            const int a_major = a.cc / 10;
            // SASS runs on its own major version at the same or a later minor; 'a' SASS and
            // PTX only on that exact device, 'f' within the family.
            const bool sass_ok = a.suffix == 'a' ? cc == a.cc : a_major == major && a.cc <= cc;
            const bool ptx_ok = a.suffix == 'a' ? cc == a.cc : a.suffix == 'f' ? sass_ok : a.cc <= cc;
            if ((a.sass && sass_ok) || (a.ptx && ptx_ok)) return true;
        }
        p = end;
    }
    return !*known;
}

// What the runtime says of one device.
struct DeviceFacts {
    int ordinal;
    const char* name;
    int major, minor;       // compute capability
    bool image_loads;       // cudaFuncGetAttributes on a kernel succeeded there
    const char* image_error;  // the runtime's words when it did not ("" otherwise)
};

// Whether the device can run this library's kernels (built for `built`); if not, why,
// naming the device and its architecture, in reason[size].
inline bool device_usable(const DeviceFacts& f, const char* built, char* reason, size_t size) {
    bool known = false;
    if (!arch_supported(built, f.major, f.minor, &known)) {
        std::snprintf(reason, size,
                      "CUDA device %d (%s) is sm_%d%d (compute capability %d.%d), but this libpyfa has "
                      "kernels for CMAKE_CUDA_ARCHITECTURES \"%s\" only; rebuild with %d%d in that list",
                      f.ordinal, f.name, f.major, f.minor, f.major, f.minor, built, f.major, f.minor);
        return false;
    }
    if (!f.image_loads) {
        std::snprintf(reason, size, "CUDA device %d (%s, sm_%d%d): no kernel image of this libpyfa loads: %s",
                      f.ordinal, f.name, f.major, f.minor, f.image_error);
        return false;
    }
    if (size) reason[0] = '\0';
    return true;
}

// Where one tensor of a *_device call lives, from cudaPointerGetAttributes.
enum class MemoryKind { kHost, kDevice, kManaged };

struct PointerFacts {
    const char* name;  // the tensor, for messages ("q", "k", "o", ...)
    MemoryKind kind;
    int device;        // the owning device (kDevice, kManaged)
};

// The device a *_device call runs on: the one that owns q (tensors[0]). Every tensor must
// be device memory of that device or managed memory (reachable from any device); host
// memory, another device's memory and a stream of another device are refused, naming
// what is wrong. stream_device: the stream's device, or -1 where it cannot be asked
// (the default streams, which follow the current device, or a runtime before 12.8).
inline bool owning_device(const PointerFacts* tensors, int count, int stream_device, int* device, char* why,
                          size_t size) {
    if (count < 1) {
        std::snprintf(why, size, "no tensors");
        return false;
    }
    int owner = tensors[0].device;
    const char* owner_name = tensors[0].name;
    for (int t = 0; t < count; ++t)
        if (tensors[t].kind == MemoryKind::kDevice) {
            owner = tensors[t].device;
            owner_name = tensors[t].name;
            break;
        }
    for (int t = 0; t < count; ++t) {
        const PointerFacts& p = tensors[t];
        if (p.kind == MemoryKind::kHost) {
            std::snprintf(why, size, "%s: a host pointer, but the *_device entry points take CUDA device memory "
                          "(use the host entry point for host memory)", p.name);
            return false;
        }
        if (p.kind == MemoryKind::kDevice && p.device != owner) {
            std::snprintf(why, size, "%s: on CUDA device %d, but %s is on device %d; every tensor of a call "
                          "must be on one device", p.name, p.device, owner_name, owner);
            return false;
        }
    }
    if (stream_device >= 0 && stream_device != owner) {
        std::snprintf(why, size, "stream: belongs to CUDA device %d, but %s is on device %d", stream_device,
                      owner_name, owner);
        return false;
    }
    *device = owner;
    return true;
}

}  // namespace pyfa
