# The commands of the Bazel genrules that the CMake build needs (cmake/targets.cmake records each
# genrule's srcs and outs; its command is Bazel's shell and is written again here, portably).

function(fsdp_cpp_genrule_command label ins outs)
  if(label STREQUAL "//examples:corpus_text_cc")
    # examples/data/corpus.txt as a function returning its text (examples/BUILD.bazel).
    add_custom_command(
      OUTPUT ${outs}
      COMMAND "${CMAKE_COMMAND}" "-DIN=${ins}" "-DOUT=${outs}"
              -P "${FSDP_CPP_SOURCE_DIR}/cmake/embed_corpus_text.cmake"
      DEPENDS ${ins} "${FSDP_CPP_SOURCE_DIR}/cmake/embed_corpus_text.cmake"
      COMMENT "Embedding examples/data/corpus.txt"
      VERBATIM)
  else()
    message(FATAL_ERROR "fsdp_cpp: the genrule ${label} has no CMake command; add one to "
                        "cmake/fsdp_cpp_genrules.cmake")
  endif()
endfunction()
