// vLLM's per-position log-probs as JSON (`[{"9707": {"logprob": -0.31, "rank": 1, ...}}, ...]`) -> every entry's
// token id and log-prob, and each position's entry count, without a Python object per position.
//
// Strict, a subset of JSON: each position a non-empty object whose keys are token ids (decimal digits, no
// leading zero) and whose values are objects holding one "logprob" number beside other fields of scalar value
// (ASCII strings with valid escapes but no surrogates, numbers, true, false, null). Anything else (null positions, nested values,
// non-ASCII bytes, escaped keys, NaN) is refused with the byte offset, and the caller reads the text the
// general way.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "routes_kernels.h"

namespace r3 {

namespace {

inline bool is_space(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
inline bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
inline bool is_hex(uint8_t c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

class Scanner {
 public:
  Scanner(const uint8_t* text, int64_t size, int64_t pos) : text_(text), size_(size), pos_(pos) {}

  int64_t pos() const { return pos_; }

  void space() {
    while (pos_ < size_ && is_space(text_[pos_])) ++pos_;
  }

  bool peek(uint8_t c) const { return pos_ < size_ && text_[pos_] == c; }

  void expect(uint8_t c) {
    TORCH_CHECK(peek(c), "offset ", pos_, ": expected '", static_cast<char>(c), "'");
    ++pos_;
  }

  // After an entry: true for ',' (another follows), false for the closing `close`.
  bool next_or_close(uint8_t close) {
    space();
    if (peek(',')) {
      ++pos_;
      space();
      return true;
    }
    expect(close);
    return false;
  }

  // A string of printable ASCII and valid escapes; returns whether it held an escape.
  bool string() {
    expect('"');
    bool escaped = false;
    while (true) {
      TORCH_CHECK(pos_ < size_, "offset ", pos_, ": the text ends inside a string");
      const uint8_t c = text_[pos_++];
      if (c == '"') return escaped;
      TORCH_CHECK(c >= 0x20 && c < 0x80, "offset ", pos_ - 1, ": a control or non-ASCII byte in a string");
      if (c != '\\') continue;
      escaped = true;
      TORCH_CHECK(pos_ < size_, "offset ", pos_, ": the text ends inside a string");
      const uint8_t e = text_[pos_++];
      if (e == 'u') {
        for (int i = 0; i < 4; ++i) TORCH_CHECK(pos_ < size_ && is_hex(text_[pos_++]), "offset ", pos_, ": bad \\u");
        // A surrogate (paired or lone: orjson refuses the latter, the standard library reads it) is left to the
        // general path.
        const uint8_t first = text_[pos_ - 4] | 0x20, second = text_[pos_ - 3] | 0x20;
        TORCH_CHECK(!(first == 'd' && second >= '8'), "offset ", pos_ - 6, ": a surrogate escape");
      } else {
        TORCH_CHECK(std::strchr("\"\\/bfnrt", e) != nullptr && e != 0, "offset ", pos_ - 1, ": bad escape");
      }
    }
  }

  // A token id key, "<digits>" without a leading zero.
  int64_t token_key() {
    expect('"');
    const int64_t first = pos_;
    int64_t value = 0;
    while (pos_ < size_ && is_digit(text_[pos_]) && pos_ - first < 18) value = value * 10 + (text_[pos_++] - '0');
    TORCH_CHECK(pos_ > first && !(text_[first] == '0' && pos_ - first > 1), "offset ", first, ": not a token id");
    expect('"');
    return value;
  }

  // A JSON number. An integer literal is read as an integer first (JSON's "-0" is the integer 0, as a
  // parser gives it) and refused beyond 15 digits (exact in a double); others as the nearest double (up to
  // 63 characters).
  double number() {
    const int64_t first = pos_;
    if (peek('-')) ++pos_;
    const int64_t digits = pos_;
    TORCH_CHECK(pos_ < size_ && is_digit(text_[pos_]), "offset ", first, ": not a number");
    if (text_[pos_] == '0') {
      ++pos_;
    } else {
      while (pos_ < size_ && is_digit(text_[pos_])) ++pos_;
    }
    const int64_t int_end = pos_;
    bool integer = true;
    if (peek('.')) {
      integer = false;
      ++pos_;
      TORCH_CHECK(pos_ < size_ && is_digit(text_[pos_]), "offset ", pos_, ": no digits after '.'");
      while (pos_ < size_ && is_digit(text_[pos_])) ++pos_;
    }
    if (peek('e') || peek('E')) {
      integer = false;
      ++pos_;
      if (peek('+') || peek('-')) ++pos_;
      TORCH_CHECK(pos_ < size_ && is_digit(text_[pos_]), "offset ", pos_, ": no digits in the exponent");
      while (pos_ < size_ && is_digit(text_[pos_])) ++pos_;
    }
    if (integer) {
      TORCH_CHECK(int_end - digits <= 15, "offset ", first, ": integer too long");
      int64_t magnitude = 0;
      for (int64_t i = digits; i < int_end; ++i) magnitude = magnitude * 10 + (text_[i] - '0');
      return static_cast<double>(text_[first] == '-' ? -magnitude : magnitude);
    }
    // strtod on a terminated copy: correctly rounded (glibc), never reads past the number, and a locale whose
    // decimal point is not '.' stops it early, which refuses the number rather than misreading it.
    char copy[64];
    const int64_t length = pos_ - first;
    TORCH_CHECK(length < static_cast<int64_t>(sizeof(copy)), "offset ", first, ": number too long");
    std::memcpy(copy, text_ + first, length);
    copy[length] = '\0';
    char* end = nullptr;
    const double value = std::strtod(copy, &end);
    TORCH_CHECK(end == copy + length && std::isfinite(value), "offset ", first, ": number out of range");
    return value;
  }

  // A scalar field value: a string, a number, true, false or null.
  void scalar() {
    TORCH_CHECK(pos_ < size_, "offset ", pos_, ": the text ends before a value");
    const uint8_t c = text_[pos_];
    if (c == '"') {
      string();
      return;
    }
    if (c == '-' || is_digit(c)) {
      number();
      return;
    }
    for (const char* word : {"true", "false", "null"}) {
      const int64_t length = static_cast<int64_t>(std::strlen(word));
      if (size_ - pos_ >= length && std::memcmp(text_ + pos_, word, length) == 0) {
        pos_ += length;
        return;
      }
    }
    TORCH_CHECK(false, "offset ", pos_, ": not a scalar value");
  }

  // {"logprob": number, other scalar fields...}: the log-prob.
  double logprob_object() {
    expect('{');
    space();
    bool found = false;
    double logprob = 0;
    do {
      const int64_t key = pos_;
      TORCH_CHECK(!string(), "offset ", key, ": an escaped key");
      const bool is_logprob = pos_ - key == 9 && std::memcmp(text_ + key, "\"logprob\"", 9) == 0;
      space();
      expect(':');
      space();
      if (is_logprob) {
        TORCH_CHECK(!found, "offset ", key, ": \"logprob\" twice");
        found = true;
        logprob = number();
      } else {
        scalar();
      }
    } while (next_or_close('}'));
    TORCH_CHECK(found, "offset ", pos_, ": an entry without \"logprob\"");
    return logprob;
  }

 private:
  const uint8_t* text_;
  int64_t size_;
  int64_t pos_;
};

at::Tensor to_tensor(const void* data, int64_t count, at::ScalarType type) {
  at::Tensor out = at::empty({count}, type);
  if (count) std::memcpy(out.data_ptr(), data, count * out.element_size());
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> parse_logprob_positions(const uint8_t* text, int64_t size,
                                                                                 int64_t start) {
  TORCH_CHECK(start >= 0 && start <= size, "start ", start, " outside [0, ", size, "]");
  Scanner scan(text, size, start);
  std::vector<int64_t> tokens, counts;
  std::vector<double> logprobs;
  scan.space();
  scan.expect('[');
  scan.space();
  do {
    scan.expect('{');
    scan.space();
    int64_t count = 0;
    do {
      tokens.push_back(scan.token_key());
      scan.space();
      scan.expect(':');
      scan.space();
      logprobs.push_back(scan.logprob_object());
      ++count;
    } while (scan.next_or_close('}'));
    counts.push_back(count);
  } while (scan.next_or_close(']'));
  return {to_tensor(tokens.data(), tokens.size(), at::kLong), to_tensor(logprobs.data(), logprobs.size(), at::kDouble),
          to_tensor(counts.data(), counts.size(), at::kLong), scan.pos()};
}

}  // namespace r3
