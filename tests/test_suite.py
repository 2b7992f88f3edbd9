"""The suite's own machinery: under pytest-xdist's --dist loadgroup (pyproject's addopts)
an xdist_group mark must reach the scheduler, or each shared build (cmake_build,
ptxas_build, the context-parallel ranks) runs on every worker while the others wait on
its lock, and the suite takes minutes longer with nothing failing."""

import pytest


@pytest.mark.xdist_group("suite_check")
def test_xdist_group_reaches_the_scheduler(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not a pytest-xdist worker under --dist loadgroup")
    # xdist tells its scheduler a test's group through this suffix of the node id.
    assert request.node.nodeid.endswith("@suite_check"), (
        f"{request.node.nodeid}: the xdist_group mark was dropped (pytest-xdist#1386 with "
        "pytest 9.2); pyproject.toml's test extra keeps pytest below it")
