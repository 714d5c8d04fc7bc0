# cmake -DIN=examples/data/corpus.txt -DOUT=corpus_text.cc -P embed_corpus_text.cmake: the same
# file as examples/BUILD.bazel's genrule //examples:corpus_text_cc writes.
file(READ "${IN}" text)
string(FIND "${text}" ")fsdp_corpus\"" found)
if(NOT found EQUAL -1)
  message(FATAL_ERROR "${IN} contains the delimiter )fsdp_corpus\"")
endif()
file(WRITE "${OUT}.tmp"
  "// Generated from examples/data/corpus.txt by //examples:corpus_text_cc.\n"
  "#include \"fsdp_cpp/examples/char_corpus.h\"\n\n"
  "namespace fsdp::examples {\n\n"
  "std::string_view embedded_corpus_text() {\n"
  "  static constexpr char kText[] = R\"fsdp_corpus(")
file(APPEND "${OUT}.tmp" "${text}")
file(APPEND "${OUT}.tmp"
  ")fsdp_corpus\";\n"
  "  return {kText, sizeof(kText) - 1};\n}\n\n}  // namespace fsdp::examples\n")
file(RENAME "${OUT}.tmp" "${OUT}")
