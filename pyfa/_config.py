"""Where a C or C++ program finds libpyfa and its headers: `pyfa.get_include()`,
`pyfa.get_library()` and `python -m pyfa --cflags | --libs | --cmake-dir`.

Two layouts:
- "package", the installed package (pip): pyfa/libpyfa.so, pyfa/include/{pyfa.h,
  pyfa_export.h}, pyfa/cmake/pyfaConfig.cmake;
- "build", a CMake build folder: libpyfa.so, include/ (the headers as installed, staged
  by CMake) and pyfaConfig.cmake in the folder itself.
The layout is the folder of the library the Python loader loads (pyfa/_lib.py decides
which), so that a program links against the very file Python uses.
"""

import argparse
import sys
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from . import _lib
from ._lib import LibraryNotFoundError

# The build-flag options of `python -m pyfa`, with their help (the demo's --help lists
# them too).
FLAGS = {
    "--cflags": "the -I flag for pyfa.h",
    "--libs": "the -L, -l and rpath flags for libpyfa",
    "--cmake-dir": "the folder holding pyfaConfig.cmake (use as pyfa_DIR or in CMAKE_PREFIX_PATH)",
}


class Layout(NamedTuple):
    library: Path      # the file a program links against (libpyfa.so)
    include_dir: Path  # holds pyfa.h and pyfa_export.h
    cmake_dir: Path    # holds pyfaConfig.cmake
    kind: str          # "package" or "build"


def _library_name() -> str:
    if sys.platform == "darwin":
        return "libpyfa.dylib"
    if sys.platform == "win32":
        raise LibraryNotFoundError("linking C programs against pyfa is supported on Linux "
                                   "and macOS only")
    return "libpyfa.so"


def _in_folder(library: Path) -> Layout:
    folder = library.parent
    if (folder / "cmake" / "pyfaConfig.cmake").is_file():
        return Layout(library, folder / "include", folder / "cmake", "package")
    return Layout(library, folder / "include", folder, "build")


def _missing(layout: Layout) -> Optional[Path]:
    for path in (layout.library, layout.include_dir / "pyfa.h",
                 layout.include_dir / "pyfa_export.h", layout.cmake_dir / "pyfaConfig.cmake"):
        if not path.is_file():
            return path
    return None


def layout() -> Layout:
    """The library the Python loader loads (pyfa/_lib.py picks it), with the headers and
    CMake package beside it; LibraryNotFoundError naming what is missing."""
    _library_name()  # refuses the platforms where linking is unsupported
    found = _in_folder(Path(_lib.library_path()))
    missing = _missing(found)
    if missing is not None:
        raise LibraryNotFoundError(
            f"libpyfa is loaded from {found.library}, but {missing} is missing beside it. "
            "Install pyfa with 'pip install .', or in a source checkout build it with "
            "'cmake -S . -B build && cmake --build build'.")
    return found


def get_include() -> str:
    """The folder holding pyfa.h and pyfa_export.h: pass it to the compiler with -I."""
    return str(layout().include_dir)


def get_library() -> str:
    """The path of libpyfa, the shared library C programs link against."""
    return str(layout().library)


def cflags() -> str:
    return f"-I{layout().include_dir}"


def libs() -> str:
    # The rpath lets the program start without LD_LIBRARY_PATH: it finds the library
    # under its SONAME in the folder it was linked from.
    library = layout().library
    folder = library.parent
    # A PYFA_LIBRARY of another name (say libpyfa.so.0.1.0) is linked by its path, so
    # that -lpyfa cannot pick a different file in the same folder.
    link = f"-L{folder} -lpyfa" if library.name == _library_name() else str(library)
    return f"{link} -Wl,-rpath,{folder}"


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pyfa",
        description="Compiler and linker flags for building C or C++ programs against "
                    "this pyfa, like pkg-config. Several flags print on one line, in the "
                    "order given.")
    parts = {"--cflags": cflags, "--libs": libs, "--cmake-dir": lambda: str(layout().cmake_dir)}
    for flag, help in FLAGS.items():
        ap.add_argument(flag, dest="parts", action="append_const", const=parts[flag], help=help)
    args = ap.parse_args(argv)
    try:
        print(" ".join(part() for part in args.parts))
    except LibraryNotFoundError as e:
        print(f"python -m pyfa: {e}", file=sys.stderr)
        return 1
    return 0


def wanted(argv: Sequence[str]) -> bool:
    """True when the command line asks for build flags rather than the demo."""
    return any(arg in FLAGS for arg in argv)
