// Atomic directories: a committed folder appears whole (new target or over an existing one, whose
// old contents disappear), listings, the small file helpers and their errors, checked on disk.
#include "fsdp_cpp/storage/atomic_directory.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace storage = fsdp::storage;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

// A fresh, empty folder for one test case.
std::string scratch(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const fs::path dir = fs::path(base ? base : "/tmp") / ("atomic_directory_test." + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

// Reads a file with the standard library (an independent check of write_file).
std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("temporary_sibling is a hidden sibling of the directory", "[storage][atomic]") {
  CHECK(storage::temporary_sibling("/ckpt/step-100") == "/ckpt/.step-100.partial");
  CHECK(storage::temporary_sibling("/ckpt/step-100/") == "/ckpt/.step-100.partial");
  CHECK(storage::temporary_sibling("step-7") == ".step-7.partial");
  CHECK(storage::temporary_sibling("a/b") == "a/.b.partial");
  REQUIRE_THROWS_WITH(storage::temporary_sibling("/"), Contains("temporary_sibling") && Contains("'/'"));
  REQUIRE_THROWS_WITH(storage::temporary_sibling(""), Contains("temporary_sibling"));
}

TEST_CASE("write_file, read_file, exists and list_files", "[storage][atomic]") {
  const auto dir = scratch("files");
  const std::string binary("a\0b\xff\n", 5);
  storage::write_file(dir + "/b.bin", binary);
  storage::write_file(dir + "/a.txt", "hello");
  storage::write_file(dir + "/empty", "");
  storage::create_directories(dir + "/sub/deeper");
  storage::write_file(dir + "/sub/c.txt", "not listed");
  CHECK(slurp(dir + "/b.bin") == binary);
  CHECK(storage::read_file(dir + "/b.bin") == binary);
  CHECK(storage::read_file(dir + "/a.txt") == "hello");
  CHECK(storage::read_file(dir + "/empty").empty());
  std::string big(3 << 16, 'x');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7919 % 251);
  storage::write_file(dir + "/big", big);
  CHECK(storage::read_file(dir + "/big") == big);
  storage::write_file(dir + "/a.txt", "hi");  // overwrite truncates
  CHECK(slurp(dir + "/a.txt") == "hi");

  CHECK(storage::list_files(dir) == std::vector<std::string>{"a.txt", "b.bin", "big", "empty"});
  CHECK(storage::exists(dir + "/a.txt"));
  CHECK(storage::exists(dir + "/sub"));
  CHECK_FALSE(storage::exists(dir + "/nothing"));
  storage::fsync_file(dir + "/a.txt");
  storage::fsync_directory(dir);

  REQUIRE_THROWS_WITH(storage::read_file(dir + "/nothing"),
                      Contains("read_file") && Contains(dir + "/nothing") && Contains("No such file"));
  REQUIRE_THROWS_WITH(storage::list_files(dir + "/nothing"), Contains("list_files") && Contains(dir + "/nothing"));
  REQUIRE_THROWS_WITH(storage::write_file(dir + "/nothing/x", "1"),
                      Contains("write_file") && Contains(dir + "/nothing/x"));
  REQUIRE_THROWS_WITH(storage::create_directories(dir + "/a.txt"), Contains("create_directories"));
  REQUIRE_THROWS_WITH(storage::fsync_file(dir + "/nothing"), Contains("fsync_file") && Contains(dir + "/nothing"));
}

TEST_CASE("prepare_empty_directory removes old contents and creates parents", "[storage][atomic]") {
  const auto dir = scratch("prepare");
  const auto target = dir + "/x/y/.z.partial";
  storage::prepare_empty_directory(target);
  CHECK(fs::is_directory(target));
  storage::write_file(target + "/stale", "old");
  storage::create_directories(target + "/nested");
  storage::prepare_empty_directory(target);
  CHECK(fs::is_directory(target));
  CHECK(fs::is_empty(target));
}

TEST_CASE("commit_directory creates a new target from the temporary folder", "[storage][atomic]") {
  const auto dir = scratch("commit_new");
  const auto target = dir + "/step-1";
  const auto tmp = storage::temporary_sibling(target);
  storage::prepare_empty_directory(tmp);
  storage::write_file(tmp + "/model.safetensors", "weights");
  storage::write_file(tmp + "/manifest.json", "{}");
  storage::commit_directory(tmp, target);
  CHECK_FALSE(fs::exists(tmp));
  CHECK(storage::list_files(target) == std::vector<std::string>{"manifest.json", "model.safetensors"});
  CHECK(slurp(target + "/model.safetensors") == "weights");
  // Only the target is left in the parent.
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir)) entries += e.path().filename() == "step-1" ? 1 : 100;
  CHECK(entries == 1);
}

TEST_CASE("commit_directory over an existing target replaces it whole", "[storage][atomic]") {
  const auto dir = scratch("commit_existing");
  const auto target = dir + "/latest";
  storage::create_directories(target + "/old_subdir");
  storage::write_file(target + "/a", "old a");
  storage::write_file(target + "/only_old", "gone after commit");
  storage::write_file(target + "/old_subdir/x", "gone too");
  struct stat before;
  REQUIRE(::stat(target.c_str(), &before) == 0);

  const auto tmp = storage::temporary_sibling(target);
  storage::prepare_empty_directory(tmp);
  storage::write_file(tmp + "/a", "new a");
  storage::write_file(tmp + "/b", "new b");
  storage::commit_directory(tmp, target);

  CHECK_FALSE(fs::exists(tmp));
  CHECK_FALSE(fs::exists(target + ".old"));
  // The old contents went to a hidden folder that a background thread removes.
  storage::wait_for_discarded_directories();
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);
  CHECK(storage::list_files(target) == std::vector<std::string>{"a", "b"});
  CHECK_FALSE(fs::exists(target + "/old_subdir"));
  CHECK(slurp(target + "/a") == "new a");
  CHECK(slurp(target + "/b") == "new b");
  struct stat after;
  REQUIRE(::stat(target.c_str(), &after) == 0);
  CHECK(after.st_ino != before.st_ino);  // a different directory now sits at the path

  // A second commit over it works the same way.
  storage::prepare_empty_directory(tmp);
  storage::write_file(tmp + "/c", "third");
  storage::commit_directory(tmp + "/", target + "/");
  CHECK(storage::list_files(target) == std::vector<std::string>{"c"});
  CHECK_FALSE(fs::exists(tmp));
}

TEST_CASE("commit_directory errors name both paths", "[storage][atomic]") {
  const auto dir = scratch("commit_errors");
  REQUIRE_THROWS_WITH(storage::commit_directory(dir + "/missing", dir + "/target"),
                      Contains("commit_directory") && Contains(dir + "/missing") && Contains(dir + "/target"));
  CHECK_FALSE(fs::exists(dir + "/target"));
  storage::create_directories(dir + "/tmp");
  storage::write_file(dir + "/file", "a file, not a directory");
  REQUIRE_THROWS_WITH(storage::commit_directory(dir + "/tmp", dir + "/file"),
                      Contains("commit_directory") && Contains(dir + "/tmp") && Contains(dir + "/file") &&
                          Contains("not a directory"));
  CHECK(slurp(dir + "/file") == "a file, not a directory");
  CHECK(fs::is_directory(dir + "/tmp"));
}
