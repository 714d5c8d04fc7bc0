// Prints a token file as the C++ reader sees it: "tokens=N vocab=V eot=E width=W", then every
// token, one per line. tokenize_text_test.sh compares the ids with those the tokenizer produced.
//   token_file_dump FILE
#include <cstdio>
#include <vector>

#include <c10/util/Exception.h>

#include "fsdp_cpp/data/token_file.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s FILE\n", argv[0]);
    return 2;
  }
  try {
    const fsdp::data::TokenFile file(argv[1], {.check_tokens = true});
    std::printf("tokens=%lld vocab=%lld eot=%lld width=%d\n", static_cast<long long>(file.num_tokens()),
                static_cast<long long>(file.vocab_size()), static_cast<long long>(file.eot_id()), file.token_bytes());
    std::vector<int64_t> tokens(file.num_tokens());
    file.read_into(0, file.num_tokens(), tokens.data());
    for (int64_t t : tokens) std::printf("%lld\n", static_cast<long long>(t));
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
