# The Catch2 tests of tests/ under ctest (FSDP_CPP_BUILD_TESTS=ON), from the fsdp_cc_test and
# fsdp_mpi_test calls cmake/targets.cmake records:
#   fsdp_cc_test   one process; main from //tests/testing:catch_main      (ctest label "single")
#   fsdp_mpi_test  <name>_bin run by tests/testing/run_mpi_test.sh on the BUILD file's world sizes
#                  (the Bazel build's launcher, used as is), one at a time (RUN_SERIAL; label "mpi")
# Tests whose arguments name Bazel runfiles ($(location ...)) are built but not registered; the
# sh_tests of the BUILD files (scripts around binaries) are Bazel-only. Tests run in the source
# folder; the flight recorder's dumps of the fault tests go to the build folder
# (FSDP_FLIGHT_RECORDER_DIR), not into the source tree.

function(fsdp_cpp_define_test kind label)
  _fsdp_cpp_parse("${label}")
  fsdp_cpp_target_of("${label}" t)
  if(kind STREQUAL "mpi_test")
    set(main //tests/testing:mpi_test_main)
    set(t ${t}_bin)
    set(out_name ${r_NAME}_bin)
  else()
    set(main //tests/testing:catch_main //third_party/catch2:catch2)
    set(out_name ${r_NAME})
  endif()
  set(deps "")
  foreach(d IN LISTS r_DEPS main)
    fsdp_cpp_target_of("${d}" dt)
    list(APPEND deps ${dt})
  endforeach()
  set(srcs "")
  foreach(s IN LISTS r_SRCS)
    list(APPEND srcs "${FSDP_CPP_SOURCE_DIR}/${r_PACKAGE}/${s}")
  endforeach()
  add_executable(${t} ${srcs})
  _fsdp_cpp_common(${t})
  target_link_libraries(${t} PRIVATE ${deps})
  set_target_properties(${t} PROPERTIES OUTPUT_NAME ${out_name}
    RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/bin/${r_PACKAGE}")
  string(FIND "${r_ARGS}" "$(" runfiles)
  if(NOT runfiles EQUAL -1)
    message(STATUS "fsdp_cpp: ${label} built, not registered with ctest (its arguments name Bazel runfiles)")
    return()
  endif()
  set(test_name "${r_PACKAGE}/${r_NAME}")
  if(kind STREQUAL "mpi_test")
    add_test(NAME "${test_name}"
      COMMAND bash "${FSDP_CPP_SOURCE_DIR}/tests/testing/run_mpi_test.sh" "$<TARGET_FILE:${t}>"
              "${r_WORLD_SIZES}" ${r_ARGS})
    set_tests_properties("${test_name}" PROPERTIES RUN_SERIAL TRUE LABELS mpi TIMEOUT 900
      ENVIRONMENT "FSDP_FLIGHT_RECORDER_DIR=${CMAKE_BINARY_DIR}/flight_recorder")
  else()
    add_test(NAME "${test_name}" COMMAND ${t} ${r_ARGS})
    set_tests_properties("${test_name}" PROPERTIES LABELS single TIMEOUT 300
      ENVIRONMENT "OMP_NUM_THREADS=1;FSDP_FLIGHT_RECORDER_DIR=${CMAKE_BINARY_DIR}/flight_recorder")
  endif()
  set_tests_properties("${test_name}" PROPERTIES WORKING_DIRECTORY "${FSDP_CPP_SOURCE_DIR}")
endfunction()
