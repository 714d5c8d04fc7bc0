#pragma once
// A minimal JSON writer for the benchmark programs' results (objects, arrays, numbers, strings).

#include <cmath>
#include <cstdint>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp::bench {

class JsonWriter {
 public:
  JsonWriter& begin_object() { value_prefix(); out_ << '{'; first_ = true; return *this; }
  JsonWriter& end_object() { out_ << '}'; first_ = false; return *this; }
  JsonWriter& begin_array() { value_prefix(); out_ << '['; first_ = true; return *this; }
  JsonWriter& end_array() { out_ << ']'; first_ = false; return *this; }
  /// The next value is the member `name` of the enclosing object.
  JsonWriter& key(const std::string& name) {
    if (!first_) out_ << ',';
    write_string(name);
    out_ << ':';
    first_ = true;
    after_key_ = true;
    return *this;
  }
  JsonWriter& value(double v) {
    value_prefix();
    if (std::isfinite(v)) out_ << std::setprecision(17) << v;
    else out_ << "null";
    return *this;
  }
  JsonWriter& value(int64_t v) { value_prefix(); out_ << v; return *this; }
  JsonWriter& value(int v) { return value(static_cast<int64_t>(v)); }
  JsonWriter& value(bool v) { value_prefix(); out_ << (v ? "true" : "false"); return *this; }
  JsonWriter& value(const std::string& v) { value_prefix(); write_string(v); return *this; }
  JsonWriter& value(const char* v) { return value(std::string(v)); }
  /// Inserts already-serialised JSON as a value.
  JsonWriter& raw(const std::string& json) { value_prefix(); out_ << json; return *this; }
  template <typename T>
  JsonWriter& array(const std::vector<T>& values) {
    begin_array();
    for (const auto& v : values) value(v);
    return end_array();
  }
  template <typename T>
  JsonWriter& member(const std::string& name, const T& v) {
    key(name);
    return value(v);
  }
  std::string str() const { return out_.str(); }

 private:
  void value_prefix() {
    if (!after_key_ && !first_) out_ << ',';
    after_key_ = false;
    first_ = false;
  }
  void write_string(const std::string& s) {
    out_ << '"';
    for (char c : s) {
      if (c == '"' || c == '\\') out_ << '\\' << c;
      else if (static_cast<unsigned char>(c) < 0x20) out_ << "\\u" << std::hex << std::setw(4) << std::setfill('0') << int(c) << std::dec;
      else out_ << c;
    }
    out_ << '"';
  }
  std::ostringstream out_;
  bool first_ = true;
  bool after_key_ = false;
};

}  // namespace fsdp::bench
