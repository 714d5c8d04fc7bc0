#pragma once
// Directories that appear whole or not at all (checkpoints): files are written into a temporary
// sibling folder, flushed, and the folder is then renamed over the target in one step. A process
// killed at any point leaves the previous target intact (and maybe a stale temporary folder, which
// the next prepare removes).
//
//   auto tmp = fsdp::storage::temporary_sibling("/ckpt/step-100");   // "/ckpt/.step-100.partial"
//   fsdp::storage::prepare_empty_directory(tmp);
//   ... write files into tmp, fsync_file() each ...
//   fsdp::storage::commit_directory(tmp, "/ckpt/step-100");

#include <string>
#include <vector>

namespace fsdp::storage {

/// The temporary folder used while writing `dir` (a hidden sibling; the same on every rank).
std::string temporary_sibling(const std::string& dir);
/// Removes `dir` with its contents if it exists, then creates it (and missing parents).
void prepare_empty_directory(const std::string& dir);
/// Creates `dir` and its missing parents (no-op when it exists).
void create_directories(const std::string& dir);
void fsync_file(const std::string& path);
void fsync_directory(const std::string& dir);
/// fsyncs `tmp`, then makes it `dir`: an atomic rename when `dir` does not exist, else an atomic
/// exchange (renameat2 RENAME_EXCHANGE), after which the old contents are renamed to a hidden
/// sibling `.<name>.replaced-<pid>-<n>` and removed by a background thread (a process killed
/// meanwhile leaves that folder behind); fsyncs the parent.
/// `dir`, if it exists, must be a directory. On a filesystem without RENAME_EXCHANGE the
/// previous `dir` is renamed to "<dir>.old", `tmp` to `dir`, and "<dir>.old" removed: between the
/// two renames `dir` is missing (the previous contents are whole at "<dir>.old").
/// Errors are a c10::Error naming both paths.
void commit_directory(const std::string& tmp, const std::string& dir);
/// Waits until the folders replaced by commit_directory are removed (also done at exit).
void wait_for_discarded_directories();
/// Regular files of `dir` (names only, sorted; subdirectories are not listed).
std::vector<std::string> list_files(const std::string& dir);
bool exists(const std::string& path);
/// Writes `contents` to `path` and fsyncs it.
void write_file(const std::string& path, const std::string& contents);
std::string read_file(const std::string& path);

}  // namespace fsdp::storage
