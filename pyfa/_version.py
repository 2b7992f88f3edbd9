# The one place the version is written: pyproject.toml (scikit-build-core's regex
# provider), CMakeLists.txt (project VERSION, so pyfa_version() and the SONAME) and
# pyfa.__version__ all read this line.
__version__ = "0.1.0"
# The distribution's name on the package index: pyproject.toml's [project] name (which
# cannot be read from here; tests/test_install_names.py holds the two equal). The
# package imports as `pyfa`; the index's "pyfa" is an unrelated project.
DISTRIBUTION = "pyfa-fp32"
