#include "fsdp_cpp/storage/atomic_directory.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <atomic>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>
#include <system_error>

#include <c10/util/Exception.h>

namespace fsdp::storage {
namespace {

namespace fs = std::filesystem;

#ifndef RENAME_EXCHANGE
constexpr unsigned int RENAME_EXCHANGE = 1U << 1;
#endif

std::string error_text(int err) { return std::strerror(err); }

// Closes a file descriptor on every path out of a scope.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }
  /// Closes now and reports the error close() returns (a deferred write error on some filesystems).
  int close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

int open_retrying(const std::string& path, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

void fsync_path(const std::string& path, int flags, const char* api) {
  FileDescriptor fd(open_retrying(path, flags));
  TORCH_CHECK(fd.get() >= 0, api, ": cannot open '", path, "': ", error_text(errno));
  int rc;
  do {
    rc = ::fsync(fd.get());
  } while (rc != 0 && errno == EINTR);
  TORCH_CHECK(rc == 0, api, ": fsync of '", path, "' failed: ", error_text(errno));
}

// `dir` without trailing slashes ("/" stays "/").
std::string strip_trailing_slashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

std::string parent_of(const std::string& path) {
  const auto parent = fs::path(strip_trailing_slashes(path)).parent_path().string();
  return parent.empty() ? "." : parent;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void remove_tree(const std::string& path, const char* api) {
  std::error_code ec;
  fs::remove_all(path, ec);
  TORCH_CHECK(!ec, api, ": cannot remove '", path, "': ", ec.message());
}

int rename_exchange(const std::string& a, const std::string& b) {
  const long rc = ::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE);
  return rc == 0 ? 0 : errno;
}

}  // namespace

std::string temporary_sibling(const std::string& dir) {
  const std::string clean = strip_trailing_slashes(dir);
  TORCH_CHECK(!clean.empty() && clean != "/" && clean != "." && clean != "..",
              "temporary_sibling: '", dir, "' does not name a directory that can have a sibling");
  const auto slash = clean.rfind('/');
  const std::string parent = slash == std::string::npos ? "" : clean.substr(0, slash + 1);
  const std::string name = slash == std::string::npos ? clean : clean.substr(slash + 1);
  return parent + "." + name + ".partial";
}

void prepare_empty_directory(const std::string& dir) {
  remove_tree(dir, "prepare_empty_directory");
  create_directories(dir);
}

void create_directories(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TORCH_CHECK(!ec, "create_directories: cannot create '", dir, "': ", ec.message());
  TORCH_CHECK(is_directory(dir), "create_directories: '", dir, "' exists and is not a directory");
}

void fsync_file(const std::string& path) { fsync_path(path, O_RDONLY, "fsync_file"); }

void fsync_directory(const std::string& dir) { fsync_path(dir, O_RDONLY | O_DIRECTORY, "fsync_directory"); }

// When `dir` exists and the filesystem cannot exchange (RENAME_EXCHANGE gives EINVAL, ENOSYS or
// EOPNOTSUPP), `dir` is renamed to "<dir>.old", then `tmp` to `dir`: between the two renames
// `dir` does not exist (the previous contents stay whole at "<dir>.old" until the new ones are in
// place, then are removed).
namespace {

// Folders replaced by a commit, being removed in the background: removing a large checkpoint's
// files takes a while on some filesystems, and the new checkpoint is in place already. The threads
// are joined by wait_for_discarded_directories() and at exit.
struct Discarder {
  std::mutex mutex;
  std::vector<std::thread> threads;
  ~Discarder() { join(); }
  void join() {
    std::vector<std::thread> running;
    {
      std::lock_guard<std::mutex> lock(mutex);
      running.swap(threads);
    }
    for (auto& t : running) t.join();
  }
};

Discarder& discarder() {
  static Discarder instance;
  return instance;
}

// Moves `path` out of the way under a name of its own (so the temporary folder's name is free at
// once for the next save) and removes it in the background; if the rename fails, removes it now.
void discard_directory(const std::string& path, const std::string& target) {
  static std::atomic<uint64_t> counter{0};
  const fs::path t(target);
  const std::string trash = (t.parent_path() / ("." + t.filename().string() + ".replaced-" +
                                                std::to_string(::getpid()) + "-" + std::to_string(counter++)))
                                .string();
  if (::rename(path.c_str(), trash.c_str()) != 0) {
    remove_tree(path, "commit_directory");
    return;
  }
  std::lock_guard<std::mutex> lock(discarder().mutex);
  discarder().threads.emplace_back([trash] {
    std::error_code ec;
    fs::remove_all(trash, ec);  // best effort: a leftover hidden folder is harmless
  });
}

}  // namespace

void wait_for_discarded_directories() { discarder().join(); }

void commit_directory(const std::string& tmp, const std::string& dir) {
  const std::string target = strip_trailing_slashes(dir);
  TORCH_CHECK(is_directory(tmp), "commit_directory: the temporary directory '", tmp,
              "' to commit as '", dir, "' does not exist or is not a directory");
  fsync_directory(tmp);
  struct stat st;
  const bool target_exists = ::lstat(target.c_str(), &st) == 0;
  TORCH_CHECK(!target_exists || S_ISDIR(st.st_mode), "commit_directory: cannot commit '", tmp, "' as '", dir,
              "': the target exists and is not a directory");
  if (!target_exists) {
    TORCH_CHECK(::rename(tmp.c_str(), target.c_str()) == 0, "commit_directory: renaming '", tmp, "' to '", dir,
                "' failed: ", error_text(errno));
  } else {
    const int err = rename_exchange(tmp, target);
    if (err == 0) {
      // `tmp` now holds the previous contents of `dir`.
      discard_directory(tmp, target);
    } else {
      TORCH_CHECK(err == EINVAL || err == ENOSYS || err == EOPNOTSUPP, "commit_directory: exchanging '", tmp,
                  "' with '", dir, "' failed: ", error_text(err));
      const std::string old = target + ".old";
      remove_tree(old, "commit_directory");
      TORCH_CHECK(::rename(target.c_str(), old.c_str()) == 0, "commit_directory: moving the previous '", dir,
                  "' aside to '", old, "' failed: ", error_text(errno));
      if (::rename(tmp.c_str(), target.c_str()) != 0) {
        const int rename_err = errno;
        ::rename(old.c_str(), target.c_str());  // put the previous contents back
        TORCH_CHECK(false, "commit_directory: renaming '", tmp, "' to '", dir, "' failed: ", error_text(rename_err));
      }
      remove_tree(old, "commit_directory");
    }
  }
  fsync_directory(parent_of(target));
  const std::string tmp_parent = parent_of(tmp);
  if (fs::path(tmp_parent).lexically_normal() != fs::path(parent_of(target)).lexically_normal()) {
    fsync_directory(tmp_parent);
  }
}

std::vector<std::string> list_files(const std::string& dir) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  TORCH_CHECK(!ec, "list_files: cannot list '", dir, "': ", ec.message());
  std::vector<std::string> names;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    std::error_code type_ec;
    if (it->is_regular_file(type_ec)) names.push_back(it->path().filename().string());
  }
  TORCH_CHECK(!ec, "list_files: listing '", dir, "' failed: ", ec.message());
  std::sort(names.begin(), names.end());
  return names;
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

void write_file(const std::string& path, const std::string& contents) {
  FileDescriptor fd(open_retrying(path, O_WRONLY | O_CREAT | O_TRUNC, 0644));
  TORCH_CHECK(fd.get() >= 0, "write_file: cannot create '", path, "': ", error_text(errno));
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd.get(), contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "write_file: writing '", path, "' failed after ", done, " of ", contents.size(),
                " bytes: ", n < 0 ? error_text(errno) : std::string("no progress"));
    done += static_cast<size_t>(n);
  }
  int rc;
  do {
    rc = ::fsync(fd.get());
  } while (rc != 0 && errno == EINTR);
  TORCH_CHECK(rc == 0, "write_file: fsync of '", path, "' failed: ", error_text(errno));
  const int close_err = fd.close();
  TORCH_CHECK(close_err == 0, "write_file: closing '", path, "' failed: ", error_text(close_err));
}

std::string read_file(const std::string& path) {
  FileDescriptor fd(open_retrying(path, O_RDONLY));
  TORCH_CHECK(fd.get() >= 0, "read_file: cannot open '", path, "': ", error_text(errno));
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, "read_file: reading '", path, "' failed: ", error_text(errno));
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  return contents;
}

}  // namespace fsdp::storage
