#include "fsdp_cpp/comm/flight_recorder.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

namespace fsdp::comm::flight_recorder {
namespace {

// Sizes of an entry's strings (with their NUL); longer strings are truncated.
constexpr size_t kNameLen = 64;
constexpr size_t kWorldRanksLen = 96;
constexpr size_t kKindLen = 24;
constexpr size_t kLabelLen = 96;
constexpr size_t kApiLen = 192;
constexpr size_t kDtypeLen = 16;
constexpr size_t kErrorLen = 320;
constexpr int kReasons = 4;  // dump reasons remembered (this dump's and the earlier ones)
constexpr size_t kReasonLen = 320;

// One entry of the ring: fixed-size, so that recording allocates nothing and a signal handler can
// format it.
struct Slot {
  uint64_t id;  // 0: empty
  uint64_t sequence;
  uint64_t channel_sequence;
  uint64_t backend_sequence;
  int64_t issued_ns;
  int64_t started_ns;
  int64_t finished_ns;
  int64_t input_elements;
  int64_t output_elements;
  int64_t bytes;
  int32_t comm_size;
  int32_t comm_rank;
  int32_t world_rank;
  int32_t peer;
  int32_t tag;
  State state;
  bool point_to_point;
  char comm_name[kNameLen];
  char world_ranks[kWorldRanksLen];
  char kind[kKindLen];
  char label[kLabelLen];
  char api[kApiLen];
  char dtype[kDtypeLen];
  char error[kErrorLen];
};

struct Recorder {
  std::atomic<bool> locked{false};
  Slot* slots = nullptr;
  int capacity = 0;
  uint64_t next_id = 0;  // ids handed out (the last one)
  bool rank_from_comm = false;
  int rank = -1;
  char dir[1024] = {};
  char path[1200] = {};
  char tmp_path[1240] = {};
  char signal_tmp_path[1240] = {};  // a signal handler's, apart from a dump() it may interrupt
  char host[128] = {};
  char rank_name[32] = {};
  char reasons[kReasons][kReasonLen] = {};
  int reason_count = 0;
};

std::atomic<Recorder*> g_recorder{nullptr};
thread_local uint64_t t_issuing = 0;

int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// Copies `src` into `dst` (capacity `cap`, NUL-terminated), truncated at a UTF-8 character boundary.
void copy(char* dst, size_t cap, const char* src) {
  if (src == nullptr) src = "";
  size_t n = 0;
  while (n + 1 < cap && src[n] != '\0') ++n;
  if (src[n] != '\0') {
    while (n > 0 && (static_cast<unsigned char>(src[n]) & 0xC0) == 0x80) --n;  // not mid-character
  }
  std::memcpy(dst, src, n);
  dst[n] = '\0';
}

class Lock {
 public:
  explicit Lock(Recorder& r) : r_(r) {
    int spins = 0;
    while (r_.locked.exchange(true, std::memory_order_acquire)) {
      if (++spins > 64) std::this_thread::yield();
    }
  }
  ~Lock() { r_.locked.store(false, std::memory_order_release); }

 private:
  Recorder& r_;
};

// In a signal handler: the lock if it frees within a while (the handler may run on the thread that
// holds it: then the ring is read as it is).
bool try_lock_for_signal(Recorder& r) {
  for (int i = 0; i < 10000; ++i) {  // a lock is held for well under a microsecond
    if (!r.locked.exchange(true, std::memory_order_acquire)) return true;
    if (i > 64) sched_yield();
  }
  return false;
}

void update_path_locked(Recorder& r) {
  if (r.rank >= 0) {
    std::snprintf(r.rank_name, sizeof(r.rank_name), "rank%d", r.rank);
  } else {
    std::snprintf(r.rank_name, sizeof(r.rank_name), "pid%d", static_cast<int>(getpid()));
  }
  std::snprintf(r.path, sizeof(r.path), "%s/flight_recorder.%s.json", r.dir, r.rank_name);
  std::snprintf(r.tmp_path, sizeof(r.tmp_path), "%s.tmp%d", r.path, static_cast<int>(getpid()));
  std::snprintf(r.signal_tmp_path, sizeof(r.signal_tmp_path), "%s.signal.tmp%d", r.path, static_cast<int>(getpid()));
}

void set_dir_locked(Recorder& r, const char* dir) {
  if (dir != nullptr && dir[0] == '/') {
    copy(r.dir, sizeof(r.dir), dir);
  } else {
    char cwd[800] = {};
    if (getcwd(cwd, sizeof(cwd)) == nullptr) std::strcpy(cwd, ".");
    std::snprintf(r.dir, sizeof(r.dir), "%s/%s", cwd, dir != nullptr ? dir : "fsdp_flight_recorder");
  }
  size_t n = std::strlen(r.dir);
  while (n > 1 && r.dir[n - 1] == '/') r.dir[--n] = '\0';
  update_path_locked(r);
}

int env_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "RANK", "SLURM_PROCID"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    char* end = nullptr;
    const long v = std::strtol(value, &end, 10);
    if (end != nullptr && *end == '\0' && v >= 0) return static_cast<int>(v);
  }
  return -1;
}

void install_signal_handlers();

bool signals_wanted() {
  const char* signals = std::getenv("FSDP_FLIGHT_RECORDER_SIGNALS");
  return signals == nullptr || std::strcmp(signals, "0") != 0;
}

Recorder& recorder() {
  static Recorder* instance = [] {
    auto* r = new Recorder();  // never freed: signal handlers may read it until the process ends
    int entries = kDefaultEntries;
    if (const char* value = std::getenv("FSDP_FLIGHT_RECORDER_ENTRIES")) {
      char* end = nullptr;
      const long v = std::strtol(value, &end, 10);
      if (end != value && v >= 0) {
        entries = static_cast<int>(std::min<long>(v, 1L << 24));
      } else {
        std::fprintf(stderr, "fsdp flight recorder: FSDP_FLIGHT_RECORDER_ENTRIES='%s' is not a count; "
                     "keeping %d entries\n", value, kDefaultEntries);
      }
    }
    r->capacity = entries;
    if (entries > 0) r->slots = new Slot[entries]();
    if (gethostname(r->host, sizeof(r->host) - 1) != 0) std::strcpy(r->host, "?");
    r->rank = env_rank();
    set_dir_locked(*r, std::getenv("FSDP_FLIGHT_RECORDER_DIR"));
    g_recorder.store(r);
    if (entries > 0 && signals_wanted()) install_signal_handlers();
    return r;
  }();
  return *instance;
}

Slot* slot_locked(Recorder& r, uint64_t id) {
  if (id == 0 || r.capacity == 0) return nullptr;
  Slot* s = &r.slots[(id - 1) % static_cast<uint64_t>(r.capacity)];
  return s->id == id ? s : nullptr;
}

// ---- JSON, written into a fixed buffer and flushed to a file descriptor (async-signal-safe) or
// appended to a string.
class Writer {
 public:
  Writer(char* buffer, size_t capacity, int fd, std::string* out)
      : buf_(buffer), cap_(capacity), fd_(fd), out_(out) {}
  ~Writer() { flush(); }

  void raw(const char* s, size_t n) {
    for (size_t i = 0; i < n; ++i) put(s[i]);
  }
  void raw(const char* s) { raw(s, std::strlen(s)); }
  void put(char c) {
    if (used_ == cap_) flush();
    buf_[used_++] = c;
  }
  void str(const char* s) {
    static const char kHex[] = "0123456789abcdef";
    put('"');
    for (; *s != '\0'; ++s) {
      const unsigned char c = static_cast<unsigned char>(*s);
      if (c == '"' || c == '\\') {
        put('\\');
        put(static_cast<char>(c));
      } else if (c == '\n') {
        raw("\\n", 2);
      } else if (c < 0x20 || c == 0x7f) {
        raw("\\u00", 4);
        put(kHex[c >> 4]);
        put(kHex[c & 15]);
      } else {
        put(static_cast<char>(c));
      }
    }
    put('"');
  }
  void u64(uint64_t v) {
    char digits[24];
    int n = 0;
    do {
      digits[n++] = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v != 0);
    while (n > 0) put(digits[--n]);
  }
  void i64(int64_t v) {
    if (v < 0) {
      put('-');
      u64(static_cast<uint64_t>(-(v + 1)) + 1);
    } else {
      u64(static_cast<uint64_t>(v));
    }
  }
  void key(const char* k) {
    str(k);
    put(':');
  }
  void flush() {
    if (used_ == 0) return;
    if (out_ != nullptr) {
      out_->append(buf_, used_);
    } else if (fd_ >= 0) {
      size_t done = 0;
      while (done < used_) {
        const ssize_t w = ::write(fd_, buf_ + done, used_ - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
          ok_ = false;
          break;
        }
        done += static_cast<size_t>(w);
      }
    }
    used_ = 0;
  }
  bool ok() const { return ok_; }

 private:
  char* buf_;
  size_t cap_;
  size_t used_ = 0;
  int fd_;
  std::string* out_;
  bool ok_ = true;
};

void write_entry(Writer& w, const Slot& s) {
  w.put('{');
  w.key("id"); w.u64(s.id);
  w.raw(",\"comm\":"); w.str(s.comm_name);
  w.raw(",\"comm_size\":"); w.i64(s.comm_size);
  w.raw(",\"comm_rank\":"); w.i64(s.comm_rank);
  w.raw(",\"world_rank\":");
  if (s.world_rank >= 0) w.i64(s.world_rank); else w.raw("null");
  w.raw(",\"world_ranks\":");
  if (s.world_ranks[0] != '\0') w.raw(s.world_ranks); else w.raw("null");
  w.raw(",\"op\":"); w.str(s.point_to_point ? "p2p" : "collective");
  w.raw(",\"seq\":"); w.u64(s.sequence);
  w.raw(",\"backend_seq\":");
  if (s.backend_sequence != 0) w.u64(s.backend_sequence); else w.raw("null");
  w.raw(",\"kind\":"); w.str(s.kind);
  if (s.point_to_point) {
    w.raw(",\"peer\":"); w.i64(s.peer);
    w.raw(",\"tag\":"); w.i64(s.tag);
    w.raw(",\"channel_seq\":"); w.u64(s.channel_sequence);
  }
  w.raw(",\"label\":"); w.str(s.label);
  w.raw(",\"api\":"); w.str(s.api);
  w.raw(",\"dtype\":"); w.str(s.dtype);
  w.raw(",\"input_elements\":"); w.i64(s.input_elements);
  w.raw(",\"output_elements\":"); w.i64(s.output_elements);
  w.raw(",\"bytes\":"); w.i64(s.bytes);
  w.raw(",\"state\":"); w.str(to_string(s.state));
  w.raw(",\"error\":"); w.str(s.error);
  w.raw(",\"issued_ns\":"); w.i64(s.issued_ns);
  w.raw(",\"started_ns\":"); w.i64(s.started_ns);
  w.raw(",\"finished_ns\":"); w.i64(s.finished_ns);
  w.put('}');
}

// The whole dump. `slots`/`capacity`/`last_id`: the ring (live, or a copy). Async-signal-safe.
void write_dump(Writer& w, const Recorder& r, const Slot* slots, int capacity, uint64_t last_id,
                const char* reason) {
  w.put('{');
  w.key("version"); w.raw("1");
  w.raw(",\"rank\":");
  if (r.rank >= 0) w.i64(r.rank); else w.raw("null");
  w.raw(",\"rank_name\":"); w.str(r.rank_name);
  w.raw(",\"pid\":"); w.i64(getpid());
  w.raw(",\"host\":"); w.str(r.host);
  w.raw(",\"reason\":"); w.str(reason);
  w.raw(",\"earlier_reasons\":[");
  for (int i = 0; i < r.reason_count && i < kReasons; ++i) {
    if (i > 0) w.put(',');
    w.str(r.reasons[i]);
  }
  w.raw("],\"dump_time_ns\":"); w.i64(now_ns());
  w.raw(",\"capacity\":"); w.i64(capacity);
  w.raw(",\"recorded\":"); w.u64(last_id);
  w.raw(",\"entries\":[");
  const uint64_t cap = static_cast<uint64_t>(capacity);
  const uint64_t first = last_id > cap ? last_id - cap + 1 : 1;
  bool any = false;
  for (uint64_t id = first; cap > 0 && id <= last_id; ++id) {
    const Slot& s = slots[(id - 1) % cap];
    if (s.id != id) continue;  // being overwritten (a dump from a signal handler without the lock)
    w.raw(any ? ",\n" : "\n");
    any = true;
    write_entry(w, s);
  }
  w.raw("\n]}\n");
}

void remember_reason(Recorder& r, const char* reason) {
  if (r.reason_count < kReasons) {
    copy(r.reasons[r.reason_count++], kReasonLen, reason);
  } else {
    for (int i = 1; i < kReasons; ++i) std::memcpy(r.reasons[i - 1], r.reasons[i], kReasonLen);
    copy(r.reasons[kReasons - 1], kReasonLen, reason);
  }
}

// mkdir -p of r.dir (async-signal-safe).
void make_dirs(const char* dir) {
  char path[1024];
  copy(path, sizeof(path), dir);
  for (char* p = path + 1; *p != '\0'; ++p) {
    if (*p != '/') continue;
    *p = '\0';
    mkdir(path, 0755);
    *p = '/';
  }
  mkdir(path, 0755);
}

void write_stderr(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    const ssize_t w = ::write(2, s, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

// ---- signals
constexpr int kSignals[] = {SIGTERM, SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGUSR1};
struct sigaction g_previous[NSIG];
char g_signal_buffer[1 << 16];
std::atomic<int> g_signal_depth{0};

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "signal SIGTERM";
    case SIGABRT: return "signal SIGABRT";
    case SIGSEGV: return "signal SIGSEGV";
    case SIGBUS: return "signal SIGBUS";
    case SIGFPE: return "signal SIGFPE";
    case SIGILL: return "signal SIGILL";
    case SIGUSR1: return "signal SIGUSR1 (dump on request)";
    default: return "a signal";
  }
}

void signal_dump(int sig) {
  Recorder* r = g_recorder.load();
  if (r == nullptr || r->capacity == 0) return;
  const bool locked = try_lock_for_signal(*r);
  const char* reason = signal_name(sig);
  make_dirs(r->dir);
  const int fd = open(r->signal_tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  bool ok = fd >= 0;
  if (ok) {
    Writer w(g_signal_buffer, sizeof(g_signal_buffer), fd, nullptr);
    write_dump(w, *r, r->slots, r->capacity, r->next_id, reason);
    w.flush();
    ok = w.ok();
    close(fd);
    ok = ok && rename(r->signal_tmp_path, r->path) == 0;
  }
  remember_reason(*r, reason);
  if (locked) r->locked.store(false, std::memory_order_release);
  write_stderr("fsdp flight recorder: ");
  write_stderr(reason);
  write_stderr(ok ? ": wrote " : ": could not write ");
  write_stderr(r->path);
  write_stderr("\n");
}

void on_signal(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  if (g_signal_depth.fetch_add(1) == 0) signal_dump(sig);
  g_signal_depth.fetch_sub(1);
  if (sig == SIGUSR1) {
    errno = saved_errno;
    return;
  }
  const struct sigaction& previous = g_previous[sig];
  if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
    previous.sa_sigaction(sig, info, context);
  } else if ((previous.sa_flags & SA_SIGINFO) == 0 && previous.sa_handler != SIG_DFL &&
             previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
  } else {
    // The default action: restore it, and raise the signal again (delivered once this handler
    // returns; a fault raised by the kernel repeats by itself when the instruction runs again).
    sigaction(sig, &previous, nullptr);
    if (info == nullptr || info->si_code <= 0 || (sig != SIGSEGV && sig != SIGBUS && sig != SIGFPE && sig != SIGILL)) {
      raise(sig);
    }
  }
  errno = saved_errno;
}

void install_signal_handlers() {
  for (int sig : kSignals) {
    struct sigaction current {};
    if (sigaction(sig, nullptr, &current) != 0) continue;
    if ((current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == on_signal) continue;  // ours
    const bool has_handler = (current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL;
    if ((current.sa_flags & SA_SIGINFO) == 0 && current.sa_handler == SIG_IGN) continue;  // ignored
    if (sig == SIGUSR1 && has_handler) continue;  // the program's own
    struct sigaction action {};
    action.sa_sigaction = on_signal;
    action.sa_flags = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(sig, &action, &g_previous[sig]);
  }
}

}  // namespace

const char* to_string(State state) {
  switch (state) {
    case State::kIssued: return "issued";
    case State::kStarted: return "started";
    case State::kCompleted: return "completed";
    case State::kFailed: return "failed";
  }
  return "?";
}

bool enabled() { return recorder().capacity > 0; }

int capacity() { return recorder().capacity; }

uint64_t recorded() {
  Recorder& r = recorder();
  Lock lock(r);
  return r.next_id;
}

uint64_t record_issue(const Issue& issue) {
  Recorder& r = recorder();
  if (r.capacity == 0) return 0;
  const int64_t now = now_ns();
  Lock lock(r);
  const uint64_t id = ++r.next_id;
  Slot& s = r.slots[(id - 1) % static_cast<uint64_t>(r.capacity)];
  s.id = id;
  s.sequence = issue.sequence;
  s.channel_sequence = issue.channel_sequence;
  s.backend_sequence = 0;
  s.issued_ns = now;
  s.started_ns = 0;
  s.finished_ns = 0;
  s.input_elements = issue.input_elements;
  s.output_elements = issue.output_elements;
  s.bytes = issue.bytes;
  s.comm_size = issue.comm_size;
  s.comm_rank = issue.comm_rank;
  s.world_rank = issue.world_rank;
  s.peer = issue.peer;
  s.tag = issue.tag;
  s.state = State::kIssued;
  s.point_to_point = issue.point_to_point;
  copy(s.comm_name, kNameLen, issue.comm_name);
  copy(s.world_ranks, kWorldRanksLen, issue.world_ranks);
  copy(s.kind, kKindLen, issue.kind);
  copy(s.label, kLabelLen, issue.label);
  copy(s.api, kApiLen, issue.api);
  copy(s.dtype, kDtypeLen, issue.dtype);
  s.error[0] = '\0';
  return id;
}

void record_started(uint64_t id) {
  if (id == 0) return;
  Recorder& r = recorder();
  const int64_t now = now_ns();
  Lock lock(r);
  Slot* s = slot_locked(r, id);
  if (s == nullptr || s->state != State::kIssued) return;
  s->state = State::kStarted;
  s->started_ns = now;
}

void record_completed(uint64_t id) {
  if (id == 0) return;
  Recorder& r = recorder();
  const int64_t now = now_ns();
  Lock lock(r);
  Slot* s = slot_locked(r, id);
  if (s == nullptr || s->state == State::kCompleted || s->state == State::kFailed) return;
  s->state = State::kCompleted;
  s->finished_ns = now;
}

void record_failed(uint64_t id, const std::string& error) {
  if (id == 0) return;
  Recorder& r = recorder();
  const int64_t now = now_ns();
  Lock lock(r);
  Slot* s = slot_locked(r, id);
  if (s == nullptr || s->state == State::kFailed) return;
  s->state = State::kFailed;
  if (s->finished_ns == 0) s->finished_ns = now;
  copy(s->error, kErrorLen, error.c_str());
}

void record_backend_sequence(uint64_t id, uint64_t sequence) {
  if (id == 0) return;
  Recorder& r = recorder();
  Lock lock(r);
  Slot* s = slot_locked(r, id);
  if (s != nullptr) s->backend_sequence = sequence;
}

std::vector<Entry> entries() {
  Recorder& r = recorder();
  std::vector<Entry> out;
  Lock lock(r);
  const uint64_t cap = static_cast<uint64_t>(r.capacity);
  if (cap == 0) return out;
  const uint64_t first = r.next_id > cap ? r.next_id - cap + 1 : 1;
  for (uint64_t id = first; id <= r.next_id; ++id) {
    const Slot& s = r.slots[(id - 1) % cap];
    if (s.id != id) continue;
    Entry e;
    e.id = s.id;
    e.comm_name = s.comm_name;
    e.comm_size = s.comm_size;
    e.comm_rank = s.comm_rank;
    e.world_rank = s.world_rank;
    e.world_ranks = s.world_ranks;
    e.sequence = s.sequence;
    e.point_to_point = s.point_to_point;
    e.kind = s.kind;
    e.peer = s.peer;
    e.tag = s.tag;
    e.channel_sequence = s.channel_sequence;
    e.backend_sequence = s.backend_sequence;
    e.label = s.label;
    e.api = s.api;
    e.dtype = s.dtype;
    e.input_elements = s.input_elements;
    e.output_elements = s.output_elements;
    e.bytes = s.bytes;
    e.state = s.state;
    e.error = s.error;
    e.issued_ns = s.issued_ns;
    e.started_ns = s.started_ns;
    e.finished_ns = s.finished_ns;
    out.push_back(std::move(e));
  }
  return out;
}

namespace {
// A copy of the ring and what a dump names, taken under the lock.
struct Snapshot {
  std::unique_ptr<Recorder> header = std::make_unique<Recorder>();
  std::vector<Slot> slots;
  int capacity = 0;
  uint64_t last_id = 0;
};

Snapshot snapshot(Recorder& r) {
  Snapshot snap;
  Lock lock(r);
  Recorder& h = *snap.header;
  h.rank = r.rank;
  std::memcpy(h.dir, r.dir, sizeof(h.dir));
  std::memcpy(h.path, r.path, sizeof(h.path));
  std::memcpy(h.tmp_path, r.tmp_path, sizeof(h.tmp_path));
  std::memcpy(h.host, r.host, sizeof(h.host));
  std::memcpy(h.rank_name, r.rank_name, sizeof(h.rank_name));
  std::memcpy(h.reasons, r.reasons, sizeof(h.reasons));
  h.reason_count = r.reason_count;
  snap.capacity = r.capacity;
  snap.last_id = r.next_id;
  if (r.capacity > 0) snap.slots.assign(r.slots, r.slots + r.capacity);
  return snap;
}
}  // namespace

std::string to_json(const std::string& reason) {
  Recorder& r = recorder();
  Snapshot snap = snapshot(r);
  std::string out;
  std::vector<char> buffer(1 << 14);
  {
    Writer w(buffer.data(), buffer.size(), -1, &out);
    write_dump(w, *snap.header, snap.slots.data(), snap.capacity, snap.last_id, reason.c_str());
  }
  return out;
}

std::string dump(const std::string& reason) {
  Recorder& r = recorder();
  if (r.capacity == 0) return {};
  // One dump at a time within the process (a signal handler's dump does not wait for it).
  static std::mutex dumping;
  std::lock_guard<std::mutex> one_at_a_time(dumping);
  Snapshot snap = snapshot(r);
  const Recorder& h = *snap.header;
  make_dirs(h.dir);
  const int fd = open(h.tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  bool ok = fd >= 0;
  const int open_errno = errno;
  if (ok) {
    std::vector<char> buffer(1 << 16);
    Writer w(buffer.data(), buffer.size(), fd, nullptr);
    write_dump(w, h, snap.slots.data(), snap.capacity, snap.last_id, reason.c_str());
    w.flush();
    ok = w.ok();
    close(fd);
    ok = ok && rename(h.tmp_path, h.path) == 0;
  }
  {
    Lock lock(r);
    remember_reason(r, reason.c_str());
  }
  const uint64_t kept = std::min<uint64_t>(snap.last_id, static_cast<uint64_t>(snap.capacity));
  if (!ok) {
    std::fprintf(stderr, "fsdp flight recorder: could not write %s (%s): %s\n", h.path, reason.c_str(),
                 std::strerror(fd < 0 ? open_errno : errno));
    return {};
  }
  std::fprintf(stderr, "fsdp flight recorder: wrote the last %llu operations to %s (%s)\n",
               static_cast<unsigned long long>(kept), h.path, reason.c_str());
  return h.path;
}

std::string dump_path() {
  Recorder& r = recorder();
  Lock lock(r);
  return r.path;
}

void set_rank(int world_rank) {
  if (world_rank < 0) return;
  Recorder& r = recorder();
  Lock lock(r);
  if (r.rank_from_comm) return;
  r.rank_from_comm = true;
  if (r.rank == world_rank) return;
  r.rank = world_rank;
  update_path_locked(r);
}

void reset_for_testing(int entries, const std::string& dir) {
  Recorder& r = recorder();
  {
    Lock lock(r);
    // The old slots are leaked, not freed: a signal handler may be reading them.
    r.slots = entries > 0 ? new Slot[entries]() : nullptr;
    r.capacity = std::max(entries, 0);
    r.next_id = 0;
    r.reason_count = 0;
    r.rank_from_comm = false;
    if (!dir.empty()) set_dir_locked(r, dir.c_str());
  }
  // Again where a test framework replaced them (Catch2 restores its predecessors after each case).
  if (entries > 0 && signals_wanted()) install_signal_handlers();
}

IssueScope::IssueScope(uint64_t id) : outer_(t_issuing) { t_issuing = id; }
IssueScope::~IssueScope() { t_issuing = outer_; }
uint64_t IssueScope::current() { return t_issuing; }

}  // namespace fsdp::comm::flight_recorder
