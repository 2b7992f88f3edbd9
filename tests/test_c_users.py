"""libpyfa for C and C++ users, as they find it.

- The Python package (pip-installed, or a source checkout's build/ when PYTHONPATH points
  at the checkout): a C99 program and a CMake project are built with nothing but what
  `python -m pyfa --cflags --libs --cmake-dir` prints, through a shell as a user types it,
  and run without LD_LIBRARY_PATH.
- `cmake --install` into a prefix: the versioned SONAME and its symlinks, pkg-config and
  find_package(pyfa CONFIG) builds against it.
- Either way only the C ABI (pyfa_*) is exported.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pyfa
from pyfa import _config, _lib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
C_DIR = HERE / "c"
PY = shlex.quote(sys.executable)


def need(tool):
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not found: building C programs needs it")
    return path


def user_env(**extra):
    """A user's shell: the same pyfa as this process on PYTHONPATH (a child started from
    another folder must not pick up a different copy), and no LD_LIBRARY_PATH."""
    env = dict(os.environ, **extra)
    env.pop("LD_LIBRARY_PATH", None)
    package_parent = str(Path(pyfa.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    return env


def sh(command, cwd, **extra):
    run = subprocess.run(["/bin/sh", "-c", command], cwd=cwd, env=user_env(**extra),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{command}\n{run.stdout}\n{run.stderr}"
    return run.stdout


def run_program(exe):
    run = subprocess.run([str(exe)], env=user_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{exe}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    return run.stdout


def dynamic_entries(path, tag):
    need("readelf")
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(rf"\({tag}\)\s+[^\[]*\[([^\]]+)\]", out)


def exported_functions(library):
    need("nm")
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def declared_functions(include_dir):
    text = (Path(include_dir) / "pyfa.h").read_text()
    return set(re.findall(r"PYFA_API\b[^;(]*?\b(pyfa_\w+)\s*\(", text))


def test_printed_paths_hold_the_library_the_loader_uses(tmp_path):
    out = sh(f"{PY} -m pyfa --cflags --libs --cmake-dir", cwd=tmp_path).split()
    include = Path(out[0].removeprefix("-I"))
    libdir = Path(out[1].removeprefix("-L"))
    assert out[2] == "-lpyfa" and out[3] == f"-Wl,-rpath,{libdir}"
    cmake_dir = Path(out[4])
    assert str(include) == pyfa.get_include() and (include / "pyfa_export.h").is_file()
    assert (cmake_dir / "pyfaConfig.cmake").is_file()
    library = Path(pyfa.get_library())
    assert library.parent == libdir and library.is_file()
    # The header C programs compile against is the one the Python loader declares from,
    # and the library they link is the one it loads.
    assert (include / "pyfa.h").read_text() == _lib.header_path().read_text()
    assert os.path.samefile(library, _lib.library_path())


def test_unknown_flag_beside_a_build_flag_is_an_error(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pyfa", "--cflags", "--seqlen", "4"],
                         cwd=tmp_path, env=user_env(), capture_output=True, text=True)
    assert run.returncode == 2 and "--seqlen" in run.stderr


def test_a_package_without_its_library_says_so(tmp_path):
    # A copy of the Python files alone: neither the package's library nor a build folder.
    src = Path(pyfa.__file__).resolve().parent
    shutil.copytree(src, tmp_path / "pyfa", ignore=shutil.ignore_patterns(
        "*.so", "*.dylib", "include", "cmake", "__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("PYFA_LIBRARY", None)
    run = subprocess.run([sys.executable, "-m", "pyfa", "--libs"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 1 and run.stdout == ""
    # The loader's own refusal, naming where it looked.
    assert run.stderr.startswith("python -m pyfa: ") and str(tmp_path / "pyfa") in run.stderr


def test_c99_program_built_with_the_printed_flags_runs(tmp_path):
    cc = need("cc")
    sh(f"{cc} -std=c99 -Wall -Wextra -Werror -pedantic {shlex.quote(str(C_DIR / 'smoke.c'))} "
       f"-o smoke $({PY} -m pyfa --cflags --libs) -lm", cwd=tmp_path)
    out = run_program(tmp_path / "smoke")
    assert f"pyfa {pyfa.__version__}: max abs error" in out
    # The name recorded at link time (the SONAME) resolves, in the rpath folder, to the
    # very file pyfa reports and its loader opens.
    library = Path(pyfa.get_library())
    needed = [n for n in dynamic_entries(tmp_path / "smoke", "NEEDED") if n.startswith("libpyfa")]
    assert needed == dynamic_entries(library, "SONAME")
    assert os.path.samefile(library.parent / needed[0], library)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["pyfa_DIR", "CMAKE_PREFIX_PATH"])
def test_cmake_project_built_with_the_printed_cmake_dir_runs(tmp_path, how):
    cmake = need("cmake")
    sh(f'{cmake} -S {shlex.quote(str(C_DIR / "cmake_user"))} -B build '
       f'-D{how}="$({PY} -m pyfa --cmake-dir)" -DPYFA_EXPECTED_VERSION={pyfa.__version__} '
       f'&& {cmake} --build build -j2', cwd=tmp_path)
    assert "max abs error" in run_program(tmp_path / "build" / "c99_user")
    assert f"pyfa {pyfa.__version__} (C++17)" in run_program(tmp_path / "build" / "cpp17_user")


def test_package_library_exports_only_the_c_abi():
    include = pyfa.get_include()
    declared = declared_functions(include)
    assert len(declared) >= 18 and "pyfa_fa2_forward" in declared
    assert exported_functions(pyfa.get_library()) == declared


def test_package_library_soname():
    library = Path(pyfa.get_library())
    (soname,) = dynamic_entries(library, "SONAME")
    _, lib = _lib.load()
    if _config.layout().kind == "package":
        # A wheel holds one file and no symlinks: its SONAME is its own name.
        assert soname == library.name
    else:
        assert soname == f"libpyfa.so.{lib.pyfa_abi_version()}"
        assert os.path.samefile(library.parent / soname, library)


@pytest.fixture(scope="module")
def install_prefix(cmake_build):
    return cmake_build[1]


@pytest.mark.slow
@pytest.mark.xdist_group("cmake_build")
def test_pyfa_library_names_the_build_folder_programs_use(cmake_build, tmp_path):
    # The loader takes PYFA_LIBRARY alone when set; so do the flags, from its folder.
    build = cmake_build[0]
    real = build / f"libpyfa.so.{pyfa.__version__}"
    out = sh(f"{PY} -m pyfa --cflags --libs --cmake-dir", cwd=tmp_path,
             PYFA_LIBRARY=str(build / "libpyfa.so"))
    assert out.split() == [f"-I{build / 'include'}", f"-L{build}", "-lpyfa",
                           f"-Wl,-rpath,{build}", str(build)]
    out = sh(f"{PY} -m pyfa --libs", cwd=tmp_path, PYFA_LIBRARY=str(real))
    assert out.split() == [str(real), f"-Wl,-rpath,{build}"]


def installed_libdir(prefix):
    (pc,) = prefix.glob("*/pkgconfig/pyfa.pc")  # lib, lib64 or lib/<arch>: GNUInstallDirs'
    return pc.parent.parent


@pytest.mark.slow
@pytest.mark.xdist_group("cmake_build")
def test_install_prefix_has_a_versioned_soname_and_only_the_c_abi(install_prefix):
    libdir = installed_libdir(install_prefix)
    _, lib = _lib.load()
    soname = f"libpyfa.so.{lib.pyfa_abi_version()}"
    real = f"libpyfa.so.{pyfa.__version__}"
    assert os.readlink(libdir / "libpyfa.so") == soname
    assert os.readlink(libdir / soname) == real
    assert (libdir / real).is_file() and not (libdir / real).is_symlink()
    assert dynamic_entries(libdir / real, "SONAME") == [soname]
    include = install_prefix / "include"
    assert exported_functions(libdir / real) == declared_functions(include)
    assert (include / "pyfa_export.h").is_file()
    assert (libdir / "cmake" / "pyfa" / "pyfaConfig.cmake").is_file()


@pytest.mark.slow
@pytest.mark.xdist_group("cmake_build")
def test_pkg_config_build_against_install_prefix_runs(install_prefix, tmp_path):
    cc, pkg_config = need("cc"), need("pkg-config")
    pc_path = str(installed_libdir(install_prefix) / "pkgconfig")
    assert sh(f"{pkg_config} --modversion pyfa", cwd=tmp_path,
              PKG_CONFIG_PATH=pc_path).strip() == pyfa.__version__
    # pkg-config gives no rpath (an install prefix is usually on the loader's path); a
    # prefix in a temporary folder needs one.
    sh(f"{cc} -std=c99 -Wall -Wextra -Werror -pedantic {shlex.quote(str(C_DIR / 'smoke.c'))} "
       f"-o smoke $({pkg_config} --cflags --libs pyfa) "
       f"-Wl,-rpath,$({pkg_config} --variable=libdir pyfa) -lm",
       cwd=tmp_path, PKG_CONFIG_PATH=pc_path)
    assert f"pyfa {pyfa.__version__}: max abs error" in run_program(tmp_path / "smoke")


@pytest.mark.slow
@pytest.mark.xdist_group("cmake_build")
def test_find_package_against_install_prefix_runs(install_prefix, tmp_path):
    cmake = need("cmake")
    sh(f"{cmake} -S {shlex.quote(str(C_DIR / 'cmake_user'))} -B build "
       f"-DCMAKE_PREFIX_PATH={shlex.quote(str(install_prefix))} "
       f"-DPYFA_EXPECTED_VERSION={pyfa.__version__} && {cmake} --build build -j2", cwd=tmp_path)
    assert "max abs error" in run_program(tmp_path / "build" / "c99_user")
    assert f"pyfa {pyfa.__version__} (C++17)" in run_program(tmp_path / "build" / "cpp17_user")


# ---- docs/c_api.md: every route it documents, run exactly as written there

C_API_DOC = ROOT / "docs" / "c_api.md"


def doc_blocks(marker):
    """{name: text} of the fenced blocks that follow `<!-- marker: name -->` lines."""
    text = C_API_DOC.read_text()
    found = re.findall(rf"<!-- {marker}: (\S+) -->\n```\w*\n(.*?)```", text, re.S)
    return dict(found)


DOC_ROUTES = doc_blocks("test")


def test_doc_names_every_route_and_file_the_tests_run():
    assert set(DOC_ROUTES) == {"pkg-config-rpath", "pkg-config-ld-library-path",
                               "cmake-prefix-path", "python-flags", "python-cmake-dir"}
    assert set(doc_blocks("file")) == {"my.c", "CMakeLists.txt"}


def run_doc_route(name, tmp_path, **extra):
    """The route's shell block in a folder holding the doc's files, under /bin/sh -e, in a
    user's shell: `python` on PATH being this interpreter, no LD_LIBRARY_PATH and no
    PKG_CONFIG_PATH of this machine's; returns the output."""
    for file, text in doc_blocks("file").items():
        (tmp_path / file).write_text(text)
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "python").symlink_to(sys.executable)
    extra.setdefault("PATH", f"{shim}{os.pathsep}{os.environ.get('PATH', '')}")
    env = user_env(**extra)
    env.pop("PKG_CONFIG_PATH", None)
    run = subprocess.run(["/bin/sh", "-ec", DOC_ROUTES[name]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{name}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    return run.stdout


def assert_ran(out):
    assert re.search(rf"^pyfa {re.escape(pyfa.__version__)}: o\[0\] = \S+, lse\[0\] = \S+$",
                     out, re.M), out


def prefix_libdir_is_lib(prefix):
    if installed_libdir(prefix) != prefix / "lib":
        pytest.skip(f"GNUInstallDirs chose {installed_libdir(prefix)}; the doc's paths say lib")


@pytest.mark.slow
@pytest.mark.xdist_group("cmake_build")
@pytest.mark.parametrize("route", ["pkg-config-rpath", "pkg-config-ld-library-path"])
def test_documented_pkg_config_routes_run(install_prefix, tmp_path, route):
    need("cc"), need("pkg-config")
    prefix_libdir_is_lib(install_prefix)
    assert_ran(run_doc_route(route, tmp_path, PREFIX=str(install_prefix)))


@pytest.mark.slow
@pytest.mark.xdist_group("cmake_build")
def test_pkg_config_libdir_is_the_installed_library_folder(install_prefix, tmp_path):
    need("pkg-config")
    libdir = sh("pkg-config --variable=libdir pyfa", cwd=tmp_path,
                PKG_CONFIG_PATH=str(installed_libdir(install_prefix) / "pkgconfig")).strip()
    assert os.path.samefile(libdir, installed_libdir(install_prefix))
    assert (Path(libdir) / "libpyfa.so").is_file()


@pytest.mark.slow
@pytest.mark.xdist_group("cmake_build")
def test_without_rpath_or_ld_library_path_the_program_cannot_start(install_prefix, tmp_path):
    # Why the doc gives the two routes: the loader alone does not find a prefix's library.
    cc, pkg_config = need("cc"), need("pkg-config")
    prefix_libdir_is_lib(install_prefix)
    run_doc_route("pkg-config-ld-library-path", tmp_path, PREFIX=str(install_prefix))
    run = subprocess.run([str(tmp_path / "my")], env=user_env(), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 127 and "libpyfa.so" in run.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("cmake_build")
def test_documented_cmake_prefix_path_route_runs(install_prefix, tmp_path):
    need("cmake"), need("cc")
    assert_ran(run_doc_route("cmake-prefix-path", tmp_path, PREFIX=str(install_prefix)))


@pytest.mark.slow
@pytest.mark.parametrize("route", ["python-flags", "python-cmake-dir"])
def test_documented_python_routes_run(tmp_path, route):
    need("cc")
    if route == "python-cmake-dir":
        need("cmake")
    assert_ran(run_doc_route(route, tmp_path))


def normalized_declarations(text):
    """Each `pyfa_status|int|... pyfa_x(...);` declaration, comments and PYFA_API dropped,
    whitespace collapsed: {name: declaration}."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S).replace("PYFA_API", " ")
    found = re.findall(r"((?:const\s+)?\w+\*?\s+(pyfa_\w+)\s*\([^;{]*\)\s*;)", text)
    return {name: re.sub(r"\s*([(),*])\s*", r"\1", " ".join(decl.split())) for decl, name in found}


def test_doc_lists_every_entry_point_with_its_signature():
    header = normalized_declarations((ROOT / "src" / "include" / "pyfa.h").read_text())
    blocks = re.findall(r"```c\n(.*?)```", C_API_DOC.read_text(), re.S)
    listed = normalized_declarations("\n".join(b for b in blocks if "int main" not in b))
    assert "pyfa_run" in header and len(header) >= 18
    assert listed == header


@pytest.mark.slow
@pytest.mark.xdist_group("cmake_build")
def test_no_vector_function_is_shared_between_instruction_sets(cmake_build, tmp_path):
    # The cpu backend's portable and AVX2 files both use 8-lane GCC vectors, passed in
    # memory in one and in registers in the other; an out-of-line copy of a shared
    # header's function on them would be kept once for both (common/device.h,
    # PYFA_LANES). This -O0 build inlines nothing it need not, so such a copy shows here.
    need("nm")
    library = cmake_build[0] / "libpyfa.so"
    out = subprocess.run(["nm", "-C", "--defined-only", str(library)], capture_output=True, text=True,
                         check=True).stdout
    shared = [line for line in out.splitlines() if "__vector" in line and "pyfa_cpu::" not in line]
    assert not shared, "\n".join(shared[:10])
    # And the documented program runs on every instruction set this CPU has.
    program = tmp_path / "my.c"
    program.write_text(doc_blocks("file")["my.c"])
    for isa in ("portable", "avx2", "avx512", "avx512_wide"):
        env = dict(os.environ, PYFA_CPU_ISA=isa)
        built = subprocess.run(["cc", "-O0", f"-I{cmake_build[1] / 'include'}", str(program),
                                f"-L{installed_libdir(cmake_build[1])}", "-lpyfa",
                                f"-Wl,-rpath,{installed_libdir(cmake_build[1])}", "-o", str(tmp_path / "my")],
                               capture_output=True, text=True)
        assert built.returncode == 0, built.stderr
        run = subprocess.run([str(tmp_path / "my")], capture_output=True, text=True, env=env)
        if "cannot run that instruction set" in run.stderr:
            continue
        assert run.returncode == 0 and "o[0] = -1" in run.stdout, (isa, run.returncode, run.stderr)
