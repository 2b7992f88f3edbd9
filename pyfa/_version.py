# The one place the version is written: pyproject.toml (scikit-build-core's regex
# provider), CMakeLists.txt (project VERSION, so pyfa_version() and the SONAME) and
# pyfa.__version__ all read this line.
__version__ = "0.1.0"
