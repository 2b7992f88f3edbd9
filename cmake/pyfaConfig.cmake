# find_package(pyfa CONFIG): the imported target pyfa::pyfa (libpyfa and its include
# folder). The targets file beside this one locates both relative to its own folder, so
# the same file serves an install prefix, the Python package and a build tree.
include("${CMAKE_CURRENT_LIST_DIR}/pyfaTargets.cmake")
if(pyfa_FIND_COMPONENTS)
  set(pyfa_FOUND FALSE)
  set(pyfa_NOT_FOUND_MESSAGE "pyfa has no components (asked for: ${pyfa_FIND_COMPONENTS})")
endif()
