import pyfa


def _cuda_usable():
    try:
        return "cuda" in pyfa.backends()
    except pyfa.LibraryNotFoundError:
        return False


HAS_CUDA = _cuda_usable()


def pytest_report_header(config):
    try:
        return f"pyfa backends: {pyfa.backends()}, library {pyfa.library_version()}"
    except pyfa.LibraryNotFoundError as e:
        return f"pyfa library not loaded: {e}"
