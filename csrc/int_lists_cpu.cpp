// JSON nested integer lists (`[[[3, 17], [5, 2]], ...]`) -> one int32 array, without a Python int per entry.
//
// Strict: JSON whitespace, '[', ']', ',' and integers (optional '-', no leading zero, no '+', fraction or
// exponent) in int32 range; every list at one depth has the same length (no ragged rows) and no list is
// empty. Anything else is refused with the byte offset, and the caller reads the text the general way.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "routes_kernels.h"

namespace r3 {

namespace {

inline bool is_space(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

inline int64_t skip_space(const uint8_t* text, int64_t pos, int64_t size) {
  while (pos < size && is_space(text[pos])) ++pos;
  return pos;
}

}  // namespace

std::tuple<at::Tensor, std::vector<int64_t>, int64_t> parse_int_lists(const uint8_t* text, int64_t size,
                                                                      int64_t start) {
  TORCH_CHECK(start >= 0 && start <= size, "start ", start, " outside [0, ", size, "]");
  int64_t pos = skip_space(text, start, size);
  // Depth of the integers: the '[' that open the first leaf.
  std::vector<int64_t> dims;  // each depth's list length, set by its first list
  while (pos < size && text[pos] == '[') {
    dims.push_back(-1);
    pos = skip_space(text, pos + 1, size);
  }
  const int64_t depth = static_cast<int64_t>(dims.size());
  TORCH_CHECK(depth > 0, "offset ", pos, ": not a list");
  std::vector<int64_t> counts(depth, 0);  // entries so far of the open list at each depth
  // Every integer takes a digit and a separator (the last a ']'): at most (size - pos + 1) / 2 of them. The
  // tensor is written in place and its first num_values returned (no growth checks, no copy of the values).
  at::Tensor out = at::empty({(size - pos + 1) / 2}, at::kInt);
  int32_t* const values = out.data_ptr<int32_t>();
  int64_t num_values = 0;
  int64_t level = depth;  // open lists; integers are read at level == depth
  while (true) {
    // An integer of the innermost list (at most 10 digits: int32, and no int64 overflow).
    TORCH_CHECK(pos < size, "offset ", pos, ": the text ends inside the list");
    const bool negative = text[pos] == '-';
    pos += negative;
    const int64_t first = pos;
    const int64_t last = std::min<int64_t>(size, first + 10);
    int64_t magnitude = 0;
    unsigned digit;
    while (pos < last && (digit = static_cast<unsigned>(text[pos]) - '0') < 10) {
      magnitude = magnitude * 10 + digit;
      ++pos;
    }
    TORCH_CHECK(pos > first, "offset ", first, ": not an integer");
    TORCH_CHECK(!(text[first] == '0' && pos - first > 1), "offset ", first, ": integer with a leading zero");
    TORCH_CHECK(pos >= size || static_cast<unsigned>(text[pos]) - '0' >= 10, "offset ", first, ": integer too long");
    const int64_t value = negative ? -magnitude : magnitude;
    TORCH_CHECK(value >= INT32_MIN && value <= INT32_MAX, "offset ", first, ": integer outside int32");
    values[num_values++] = static_cast<int32_t>(value);
    ++counts[depth - 1];
    pos = skip_space(text, pos, size);
    TORCH_CHECK(pos < size, "offset ", pos, ": the text ends inside the list");
    if (text[pos] == ',') {
      // ", " (Python's json.dumps) and "," (compact writers) without the general whitespace loop.
      pos += 1 + (pos + 1 < size && text[pos + 1] == ' ');
      pos = skip_space(text, pos, size);
      continue;
    }
    // Close lists until a ',' opens the next one at some depth.
    while (true) {
      TORCH_CHECK(pos < size && text[pos] == ']', "offset ", pos, ": expected ',' or ']'");
      const int64_t d = level - 1;
      TORCH_CHECK(dims[d] < 0 || dims[d] == counts[d], "offset ", pos, ": a list of ", counts[d],
                  " entries where the first at its depth had ", dims[d], " (ragged)");
      dims[d] = counts[d];
      counts[d] = 0;
      --level;
      pos = skip_space(text, pos + 1, size);
      if (level == 0) {
        return {out.narrow(0, 0, num_values), dims, pos};  // the bound's storage, freed with the array
      }
      ++counts[level - 1];
      TORCH_CHECK(pos < size, "offset ", pos, ": the text ends inside the list");
      if (text[pos] == ',') break;
    }
    pos = skip_space(text, pos + 1, size);
    while (level < depth) {
      TORCH_CHECK(pos < size && text[pos] == '[', "offset ", pos, ": expected '[' (lists of one depth)");
      ++level;
      pos = skip_space(text, pos + 1, size);
    }
  }
}

}  // namespace r3
