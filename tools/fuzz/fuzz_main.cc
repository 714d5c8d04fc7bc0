// parser_fuzz: a deterministic mutation fuzzer of the parsers that read files from outside
// (safetensors headers, distributed-checkpoint manifests and files, Hugging Face indexes, .pt
// archives); see tools/fuzz/README.md for what each target drives and how to read the output.
//
//   parser_fuzz [--targets=all|a,b] [--inputs=100000] [--start=0] [--seed=1] [--timeout_s=10]
//               [--memory_mb=4096] [--rss_growth_mb=512] [--findings=DIR] [--work=DIR]
//               [--max_saved=20] [--max_crashes=50]
//               [--extra_seed=TARGET:FILE ...] [--skip_api=TARGET:API ...] [--progress_s=30]
//   parser_fuzz --target=T --replay=FILE            # one input, in this process (a reproducer)
//   parser_fuzz --target=T --seed=S --index=I [--write_input=FILE]   # input I of a run, again
//   parser_fuzz --regressions [--targets=...]       # the hand-made inputs of past findings
//
// A supervising process forks one worker per target (again after a crash); the worker writes the
// seeds with the project's writers, then for each index i builds input i (a pure function of the
// seed, the target and i: mutate.h), writes it where the parser reads it and runs the parser.
// Accepted (the parser returned) and refused (a c10::Error or std::exception with a message) are
// both fine; a finding is anything else: a crash or abort (the worker dies), a hang (over
// --timeout_s for one input: the supervisor kills the worker), an allocation beyond the memory
// limit (RLIMIT_AS of --memory_mb in the worker: std::bad_alloc, std::length_error, an allocator's
// out-of-memory error), a resident-set growth of over --rss_growth_mb for one input, an internal
// assertion, an exception without a message or not derived from std::exception. Each finding's
// input is saved in --findings with a .txt beside it (the message or signal, the worker's stderr
// for that input, the reproducer commands). --skip_api leaves out one API of a target (e.g. a
// known finding another change fixes). Exit status: 0 no finding, 1 findings, 2 harness error.

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include "mutate.h"
#include "targets.h"

namespace fs = std::filesystem;
using namespace fsdp::fuzz;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAsan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAsan = true;
#else
constexpr bool kAsan = false;
#endif
#else
constexpr bool kAsan = false;
#endif

struct Options {
  std::vector<std::string> targets;
  int64_t inputs = 100000;
  int64_t start = 0;
  uint64_t seed = 1;
  double timeout_s = 10;
  int64_t memory_mb = 4096;
  int64_t rss_growth_mb = 512;
  int64_t max_saved = 20;
  int64_t max_crashes = 50;
  double progress_s = 30;
  std::string work;
  std::string findings = "fuzz_findings";
  std::map<std::string, std::vector<std::string>> extra_seeds;
  std::map<std::string, std::set<std::string>> skip_apis;  // target -> APIs not called
  std::vector<std::string> skip_api_args;
  std::vector<std::string> extra_seed_args;
  std::string replay;
  int64_t index = -1;
  std::string write_input;
  bool regressions = false;
  std::string self;
  bool remove_work = false;  // the default work folder is removed at the end
};

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Counters shared between the supervisor and its worker (an anonymous shared mapping).
struct Shared {
  std::atomic<int64_t> current{-1};     // index being run
  std::atomic<int64_t> started_ms{0};   // when it started (0: not running an input)
  std::atomic<int64_t> next{0};         // first index not finished
  std::atomic<int64_t> accepted{0};
  std::atomic<int64_t> refused{0};
  std::atomic<int64_t> findings{0};
  std::atomic<int64_t> unnamed{0};
  std::atomic<int64_t> saved{0};
  std::atomic<int64_t> parse_us{0};
  std::atomic<int> setup_failed{0};
  std::atomic<int> generating{0};       // 1 while the worker builds an input (not a parser's fault)
  std::atomic<int64_t> torch_asserts{0};  // refusals that are LibTorch's internal assertions
  char note[1024] = {0};               // the setup error, or the first unnamed refusal
};

std::string slug(const std::string& s) {
  std::string out;
  for (char c : s) out += std::isalnum(static_cast<unsigned char>(c)) ? c : '-';
  return out;
}

std::string input_file(const Options& o, const Target& t) { return o.work + "/" + t.name() + "/current" + t.extension(); }
std::string log_file(const Options& o, const Target& t) { return o.work + "/" + t.name() + "/worker.log"; }

std::string reproducer(const Options& o, const std::string& target, const std::string& saved, int64_t index) {
  std::string extra;
  for (const auto& a : o.extra_seed_args) extra += " --extra_seed=" + a;
  for (const auto& a : o.skip_api_args) extra += " '--skip_api=" + a + "'";
  return "  replay this input:      " + o.self + " --target=" + target + " --replay=" + saved + extra +
         "\n  regenerate it (run's input " + std::to_string(index) + "): " + o.self + " --target=" + target +
         " --seed=" + std::to_string(o.seed) + " --index=" + std::to_string(index) + extra + "\n";
}

std::string tail_of(const std::string& path, size_t bytes) {
  try {
    std::string text = read_whole_file(path);
    if (text.size() > bytes) text = "...\n" + text.substr(text.size() - bytes);
    return text;
  } catch (const std::exception&) {
    return "";
  }
}

// Saves a finding's input and its description; returns the saved input's path ("" past max_saved).
std::string save_finding(const Options& o, Shared& shared, const Target& t, int64_t index, const std::string& kind,
                         const std::string& input, const std::string& details) {
  if (shared.saved.fetch_add(1) >= o.max_saved) return "";
  fs::create_directories(o.findings);
  const std::string base = fs::absolute(o.findings).string() + "/" + t.name() + "-" + std::to_string(index) + "-" +
                           slug(kind);
  const std::string path = base + t.extension();
  write_whole_file(path, input);
  std::string text = std::string("target: ") + t.name() + "\nindex: " + std::to_string(index) +
                     "\nseed: " + std::to_string(o.seed) + "\nkind: " + kind + "\n" + details + "\n" +
                     reproducer(o, t.name(), path, index);
  write_whole_file(base + ".txt", text);
  return path;
}

std::string make_input(const Options& o, const Target& t, int64_t index, std::string* what) {
  Rng rng(mix(mix(o.seed, hash_text(t.name())), static_cast<uint64_t>(index)));
  return mutate(t.seeds(), t.format(), t.dictionary(), rng, what);
}

Runner make_runner(const Options& o, const Target& t) {
  const auto it = o.skip_apis.find(t.name());
  return Runner(t.locations(), o.rss_growth_mb, it == o.skip_apis.end() ? std::set<std::string>{} : it->second);
}

void limit_memory(const Options& o) {
  if (o.memory_mb <= 0 || kAsan) return;  // ASan reserves terabytes of address space for itself
  struct rlimit limit {};
  limit.rlim_cur = limit.rlim_max = static_cast<rlim_t>(o.memory_mb) << 20;
  ::setrlimit(RLIMIT_AS, &limit);
}

std::unique_ptr<Target> set_up(const Options& o, const std::string& name) {
  auto t = make_target(name);
  const std::string dir = o.work + "/" + name + "/setup";
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto it = o.extra_seeds.find(name);
  t->setup(dir, it == o.extra_seeds.end() ? std::vector<std::string>{} : it->second);
  return t;
}

// The worker: inputs [from, end) of target `name`.
[[noreturn]] void worker(const Options& o, const std::string& name, Shared& shared, int64_t from, int64_t end) {
  limit_memory(o);
  at::set_num_threads(1);
  // The worker's stderr (LibTorch warnings, sanitizer reports) goes to a log, emptied before each
  // input, so that a crash leaves the crashing input's output there.
  fs::create_directories(o.work + "/" + name);
  const int log = ::open((o.work + "/" + name + "/worker.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log >= 0) ::dup2(log, 2);
  std::unique_ptr<Target> t;
  try {
    t = set_up(o, name);
  } catch (const std::exception& e) {
    std::snprintf(shared.note, sizeof(shared.note), "setup of %s failed: %s", name.c_str(), e.what());
    shared.setup_failed = 1;
    ::_exit(3);
  }
  const std::string current = input_file(o, *t);
  for (int64_t i = from; i < end; ++i) {
    shared.current = i;
    std::string what;
    shared.generating = 1;
    const std::string input = make_input(o, *t, i, &what);
    write_whole_file(current, input);
    shared.generating = 0;
    if (log >= 0) {
      ::ftruncate(2, 0);
      ::lseek(2, 0, SEEK_SET);
    }
    const auto t0 = std::chrono::steady_clock::now();
    shared.started_ms = now_ms();
    Runner runner = make_runner(o, *t);
    t->run(input, static_cast<uint64_t>(i), runner);
    shared.started_ms = 0;
    shared.parse_us += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
    const Verdict verdict = runner.verdict();
    const std::string& kind = runner.finding_kind();
    const std::string& message = runner.message();
    switch (verdict) {
      case Verdict::kAccepted: ++shared.accepted; break;
      case Verdict::kRefused:
        ++shared.refused;
        if (runner.torch_assert()) ++shared.torch_asserts;
        break;
      case Verdict::kFinding: {
        ++shared.findings;
        const std::string saved = save_finding(o, shared, *t, i, kind, input,
                                               "mutations: " + what + "\nmessage: " + message + "\nstderr:\n" +
                                                   tail_of(log_file(o, *t), 4000));
        std::fprintf(stdout, "[%s] FINDING at input %" PRId64 " (%s): %.600s%s%s\n", name.c_str(), i, kind.c_str(),
                     message.c_str(), saved.empty() ? "" : "\n  saved: ", saved.c_str());
        std::fflush(stdout);
        break;
      }
    }
    if (runner.unnamed() && shared.unnamed.fetch_add(1) == 0) {
      std::snprintf(shared.note, sizeof(shared.note), "input %" PRId64 ": %s", i, runner.unnamed_message().c_str());
    }
    shared.next = i + 1;
  }
  std::fflush(stdout);
  ::_exit(0);
}

std::string signal_name(int sig) {
  const char* name = ::strsignal(sig);
  return "signal " + std::to_string(sig) + (name ? std::string(" (") + name + ")" : "");
}

struct TargetResult {
  std::string name;
  int64_t inputs = 0, accepted = 0, refused = 0, findings = 0, unnamed = 0, torch_asserts = 0;
  double seconds = 0, parse_seconds = 0;
  std::string note;
  bool harness_error = false;
};

// Supervises the workers of one target until inputs [start, start + inputs) are done.
TargetResult supervise(const Options& o, const std::string& name, Shared& shared) {
  TargetResult result;
  result.name = name;
  new (&shared) Shared();
  const int64_t end = o.start + o.inputs;
  int64_t next = o.start;
  int64_t crashes = 0;
  const int64_t t0 = now_ms();
  int64_t last_progress = t0;
  auto probe = make_target(name);  // names and extensions only (nothing set up in this process)
  while (next < end) {
    std::fflush(stdout);
    shared.current = -1;
    shared.started_ms = 0;
    shared.generating = 0;
    shared.next = next;
    const pid_t pid = ::fork();
    if (pid < 0) {
      result.harness_error = true;
      result.note = std::string("fork failed: ") + std::strerror(errno);
      break;
    }
    if (pid == 0) worker(o, name, shared, next, end);
    const int64_t spawned = now_ms();
    int status = 0;
    bool hung = false;
    while (true) {
      const pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      const int64_t now = now_ms();
      const int64_t started = shared.started_ms.load();
      const bool over = started != 0 ? now - started > static_cast<int64_t>(o.timeout_s * 1000)
                                     : shared.current.load() < 0 && now - spawned > 600'000;  // setup
      if (over) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        hung = true;
        break;
      }
      if (o.progress_s > 0 && now - last_progress > o.progress_s * 1000) {
        last_progress = now;
        const int64_t done = shared.next.load() - o.start;
        std::printf("[%s] %" PRId64 "/%" PRId64 " inputs, %" PRId64 " findings, %.0f inputs/s\n", name.c_str(), done,
                    o.inputs, shared.findings.load(), done * 1000.0 / std::max<int64_t>(1, now - t0));
        std::fflush(stdout);
      }
    }
    if (!hung && WIFEXITED(status) && WEXITSTATUS(status) == 0 && shared.next.load() >= end) break;
    if (shared.setup_failed.load() != 0 || shared.current.load() < 0 || shared.generating.load() != 0) {
      if (shared.generating.load() != 0) {
        std::snprintf(shared.note, sizeof(shared.note), "the worker died while building input %" PRId64
                      " (a harness bug): %s", shared.current.load(),
                      WIFSIGNALED(status) ? signal_name(WTERMSIG(status)).c_str() : "exited");
      }
      result.harness_error = true;
      result.note = shared.note[0] ? shared.note : "the worker ended during setup: " +
                                                       (WIFSIGNALED(status) ? signal_name(WTERMSIG(status))
                                                                            : "exit status " + std::to_string(WEXITSTATUS(status)));
      break;
    }
    // The worker crashed, aborted, exited early or hung on input `index`.
    const int64_t index = shared.current.load();
    std::string kind, how;
    if (hung) {
      kind = "hang";
      how = "no result after " + std::to_string(o.timeout_s) + " s (the worker was killed)";
    } else if (WIFSIGNALED(status)) {
      kind = "crash";
      how = "the worker died of " + signal_name(WTERMSIG(status));
    } else {
      kind = "exit";
      how = "the worker exited with status " + std::to_string(WEXITSTATUS(status)) + " in the middle of the run";
    }
    ++shared.findings;
    std::string input;
    try {
      input = read_whole_file(input_file(o, *probe));
    } catch (const std::exception&) {
    }
    const std::string saved = save_finding(o, shared, *probe, index, kind, input,
                                           how + "\nstderr of the worker for this input:\n" +
                                               tail_of(log_file(o, *probe), 8000));
    std::printf("[%s] FINDING at input %" PRId64 " (%s): %s%s%s\n", name.c_str(), index, kind.c_str(), how.c_str(),
                saved.empty() ? "" : "\n  saved: ", saved.c_str());
    next = index + 1;
    if (++crashes >= o.max_crashes) {
      result.note = "stopped after " + std::to_string(crashes) + " crashes";
      break;
    }
  }
  result.inputs = shared.next.load() - o.start;
  result.accepted = shared.accepted;
  result.refused = shared.refused;
  result.findings = shared.findings;
  result.unnamed = shared.unnamed;
  result.torch_asserts = shared.torch_asserts;
  result.seconds = (now_ms() - t0) / 1000.0;
  result.parse_seconds = shared.parse_us / 1e6;
  if (result.note.empty() && result.unnamed > 0) result.note = std::string("first unnamed refusal: ") + shared.note;
  return result;
}

// --replay / --index: one input in this process (no worker, no time limit): a reproducer.
int run_one(const Options& o, const std::string& name) {
  limit_memory(o);  // as in the workers, so that an allocation finding reproduces
  std::unique_ptr<Target> t;
  try {
    t = set_up(o, name);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "setup of %s failed: %s\n", name.c_str(), e.what());
    return 2;
  }
  std::string input, what;
  if (!o.replay.empty()) {
    input = read_whole_file(o.replay);
  } else {
    input = make_input(o, *t, o.index, &what);
    std::printf("input %" PRId64 ": %zu bytes; mutations: %s\n", o.index, input.size(), what.c_str());
    if (!o.write_input.empty()) write_whole_file(o.write_input, input);
  }
  Runner runner = make_runner(o, *t);
  t->run(input, static_cast<uint64_t>(std::max<int64_t>(o.index, 0)), runner);
  static const char* kVerdicts[] = {"accepted", "refused", "FINDING"};
  std::printf("%s: %s%s%s\n", name.c_str(), kVerdicts[static_cast<int>(runner.verdict())],
              runner.finding_kind().empty() ? "" : (" (" + runner.finding_kind() + ")").c_str(),
              runner.message().empty() ? "" : (": " + runner.message()).c_str());
  return runner.verdict() == Verdict::kFinding ? 1 : 0;
}

// --regressions: the hand-made inputs of the bugs found so far (Target::regressions), in this
// process: each must be refused with a message. Returns the number that were not.
int run_regressions(const Options& o) {
  limit_memory(o);
  at::set_num_threads(1);
  int failed = 0, count = 0;
  for (const auto& name : o.targets) {
    std::unique_ptr<Target> t;
    try {
      t = set_up(o, name);
    } catch (const std::exception& e) {
      std::printf("[%s] setup failed: %s\n", name.c_str(), e.what());
      ++failed;
      continue;
    }
    for (const auto& [what, input] : t->regressions()) {
      Runner runner = make_runner(o, *t);
      t->run(input, 0, runner);
      const bool ok = runner.verdict() == Verdict::kRefused;
      ++count;
      failed += ok ? 0 : 1;
      std::printf("[%s] regression '%s': %s%s%.300s\n", name.c_str(), what.c_str(), ok ? "refused" : "FAILED, ",
                  ok ? ": " : (runner.verdict() == Verdict::kAccepted ? "accepted" : ("finding (" + runner.finding_kind() + "): ").c_str()),
                  runner.message().c_str());
      std::fflush(stdout);  // a crash in the next one leaves this line
    }
  }
  std::printf("parser_fuzz: %d regression inputs, %d not refused\n", count, failed);
  std::fflush(stdout);
  return failed;
}

bool parse_args(int argc, char** argv, Options& o) {
  o.self = fs::absolute(argv[0]).string();
  std::string targets = "all";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto eq = arg.find('=');
    const std::string key = arg.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : arg.substr(eq + 1);
    if (key == "--targets" || key == "--target") {
      targets = value;
    } else if (key == "--inputs") {
      o.inputs = std::stoll(value);
    } else if (key == "--start") {
      o.start = std::stoll(value);
    } else if (key == "--seed") {
      o.seed = std::stoull(value);
    } else if (key == "--timeout_s") {
      o.timeout_s = std::stod(value);
    } else if (key == "--memory_mb") {
      o.memory_mb = std::stoll(value);
    } else if (key == "--rss_growth_mb") {
      o.rss_growth_mb = std::stoll(value);
    } else if (key == "--max_crashes") {
      o.max_crashes = std::stoll(value);
    } else if (key == "--max_saved") {
      o.max_saved = std::stoll(value);
    } else if (key == "--progress_s") {
      o.progress_s = std::stod(value);
    } else if (key == "--work") {
      o.work = value;
    } else if (key == "--findings") {
      o.findings = value;
    } else if (key == "--extra_seed") {
      const auto colon = value.find(':');
      if (colon == std::string::npos) {
        std::fprintf(stderr, "--extra_seed=TARGET:FILE expected, got '%s'\n", value.c_str());
        return false;
      }
      o.extra_seeds[value.substr(0, colon)].push_back(fs::absolute(value.substr(colon + 1)).string());
      o.extra_seed_args.push_back(value.substr(0, colon) + ":" + fs::absolute(value.substr(colon + 1)).string());
    } else if (key == "--skip_api") {
      const auto colon = value.find(':');
      if (colon == std::string::npos) {
        std::fprintf(stderr, "--skip_api=TARGET:API expected, got '%s'\n", value.c_str());
        return false;
      }
      o.skip_apis[value.substr(0, colon)].insert(value.substr(colon + 1));
      o.skip_api_args.push_back(value);
    } else if (key == "--replay") {
      o.replay = value;
    } else if (key == "--index") {
      o.index = std::stoll(value);
    } else if (key == "--write_input") {
      o.write_input = value;
    } else if (key == "--regressions") {
      o.regressions = true;
    } else {
      std::fprintf(stderr, "unknown option '%s' (see the top of tools/fuzz/fuzz_main.cc)\n", arg.c_str());
      return false;
    }
  }
  const auto all = target_names();
  if (targets == "all") {
    o.targets = all;
  } else {
    for (size_t b = 0; b <= targets.size();) {
      const size_t e = std::min(targets.find(',', b), targets.size());
      const std::string name = targets.substr(b, e - b);
      if (std::find(all.begin(), all.end(), name) == all.end()) {
        std::fprintf(stderr, "unknown target '%s'\n", name.c_str());
        return false;
      }
      o.targets.push_back(name);
      b = e + 1;
    }
  }
  if (o.work.empty()) {
    o.work = fs::temp_directory_path().string() + "/parser_fuzz." + std::to_string(::getpid());
    o.remove_work = true;
  }
  o.work = fs::absolute(o.work).string();
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    if (!parse_args(argc, argv, o)) return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bad option value: %s\n", e.what());
    return 2;
  }
  fs::create_directories(o.work);
  if (o.regressions) {
    const int failed = run_regressions(o);
    std::error_code ignored;
    if (o.remove_work) fs::remove_all(o.work, ignored);
    return failed > 0 ? 1 : 0;
  }
  if (!o.replay.empty() || o.index >= 0) {
    if (o.targets.size() != 1) {
      std::fprintf(stderr, "--replay and --index need one --target\n");
      return 2;
    }
    return run_one(o, o.targets[0]);
  }
  void* mapping = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED) {
    std::perror("mmap");
    return 2;
  }
  Shared& shared = *static_cast<Shared*>(mapping);
  std::printf("parser_fuzz: seed %" PRIu64 ", inputs %" PRId64 "..%" PRId64 " per target, timeout %.0f s per input, "
              "memory limit %s, work %s, findings %s\n",
              o.seed, o.start, o.start + o.inputs, o.timeout_s,
              kAsan ? "off (ASan)" : o.memory_mb > 0 ? (std::to_string(o.memory_mb) + " MiB").c_str() : "off",
              o.work.c_str(), fs::absolute(o.findings).c_str());
  std::vector<TargetResult> results;
  for (const auto& name : o.targets) {
    results.push_back(supervise(o, name, shared));
    const auto& r = results.back();
    std::printf("[%s] done: %" PRId64 " inputs in %.1f s%s%s\n", name.c_str(), r.inputs, r.seconds,
                r.note.empty() ? "" : "; ", r.note.c_str());
    std::fflush(stdout);
  }
  int64_t findings = 0;
  bool harness_error = false;
  std::printf("\n%-14s %9s %9s %9s %9s %9s %9s %9s %9s\n", "target", "inputs", "accepted", "refused", "findings",
              "unnamed", "torch_ia", "time_s", "inputs/s");
  for (const auto& r : results) {
    std::printf("%-14s %9" PRId64 " %9" PRId64 " %9" PRId64 " %9" PRId64 " %9" PRId64 " %9" PRId64 " %9.1f %9.0f\n",
                r.name.c_str(), r.inputs, r.accepted, r.refused, r.findings, r.unnamed, r.torch_asserts, r.seconds,
                r.inputs / std::max(r.seconds, 1e-9));
    findings += r.findings;
    harness_error = harness_error || r.harness_error;
    if (r.harness_error) std::printf("  %s: HARNESS ERROR: %s\n", r.name.c_str(), r.note.c_str());
  }
  std::printf("parser_fuzz: %zu targets, %" PRId64 " findings%s\n", results.size(), findings,
              harness_error ? ", HARNESS ERRORS" : "");
  std::error_code ignored;
  if (o.remove_work) fs::remove_all(o.work, ignored);
  return harness_error ? 2 : findings > 0 ? 1 : 0;
}
