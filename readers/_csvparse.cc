// Numeric CSV blocks to float32 rows: the native parser of matex.readers (no MPI, no
// TensorFlow). Built on first use by matex/_build.py (csvparse_dir) as _matex_csvparse.
//
// parse(data, delimiter, ncols, columns) -> (values, error)
//
//   data: whole lines of text. Lines end with "\n", "\r\n" or a lone "\r"; blank lines
//   (nothing but spaces and tabs) are skipped; a UTF-8 byte order mark at the start of
//   the block is skipped. Every other line must have exactly ``ncols`` fields separated
//   by the one-byte ``delimiter``. A field opening with '"' is quoted: it runs to the
//   next lone '"' ("" is a literal quote) and may hold delimiters, not line breaks.
//   values: float32 array (rows, len(columns)), column k holding field columns[k] of
//   each line. A selected field is empty (NaN; also ""), or a number as pandas' C parser
//   reads it: spaces/tabs around it, an optional sign, decimal digits with an optional
//   fraction and exponent, "inf"/"infinity" in any case, or True/False (1/0), possibly
//   quoted; it is read as a double and rounded to float32, as pandas does. "nan",
//   hexadecimal, a field of blanks only, or anything else is not a number. Fields of
//   the other columns are not looked at (beyond finding where they end).
//
//   error: None, or for the first bad line (index = number of "\n" before it in data)
//   (line, -1, fields, b"") when it has the wrong number of fields, else
//   (line, column, fields, raw field bytes) for its first non-numeric selected field.
//   (None, None): a quote does not close on its line; the caller parses the block with
//   pandas (which reads quoted line breaks).
//
// The GIL is released while parsing: several threads parse blocks at once.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <charconv>
#include <clocale>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <locale.h>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

struct BadLine {
  int64_t line = -1;        // index of the line ("\n" before it in the block)
  int column = -1;          // -1: wrong number of fields
  int fields = 0;           // fields on that line
  const char* field = nullptr;
  size_t field_len = 0;
};

struct Parser {
  char delim;
  int ncols;
  std::vector<int> slot;                  // file column -> output index, or -1
  std::vector<std::pair<int, int>> copies;  // (to, from) for columns selected twice
  int nout;
  bool blank[256];                        // spaces around fields (never the delimiter)
  bool stops[256];                        // the delimiter and line ends

  Parser(char delimiter, int n, const std::vector<int>& columns)
      : delim(delimiter), ncols(n), slot(n, -1), nout(static_cast<int>(columns.size())) {
    for (int k = 0; k < nout; ++k) {
      int c = columns[k];
      if (slot[c] < 0)
        slot[c] = k;
      else
        copies.emplace_back(k, slot[c]);
    }
    std::memset(blank, 0, sizeof blank);
    std::memset(stops, 0, sizeof stops);
    stops[static_cast<unsigned char>(delim)] = stops['\n'] = stops['\r'] = true;
    for (unsigned char c : {' ', '\t', '\v', '\f'})
      blank[c] = c != static_cast<unsigned char>(delim);
  }

  bool is_blank(char c) const { return blank[static_cast<unsigned char>(c)]; }
  static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\v' || c == '\f'; }
  bool ends_field(char c) const { return stops[static_cast<unsigned char>(c)]; }

  // Upper bound of the rows in [p, end): the lines (terminators, plus an unterminated
  // last line), and with several columns the delimiters / (ncols - 1), so that blank lines
  // take no room: when every line is good, exactly the rows.
  int64_t max_rows(const char* p, const char* end) const {
    int64_t lines = 0, delims = 0;
    const size_t size = end - p;
    for (size_t i = 0; i < size;) {   // in runs of 16 byte-wide counters (vectorized)
      const size_t n = std::min<size_t>(size - i, 255 * 16);
      uint8_t nl[16] = {0}, dl[16] = {0};
      size_t j = 0;
      for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; ++k) {
          nl[k] += p[i + j + k] == '\n';
          dl[k] += p[i + j + k] == delim;
        }
      for (int k = 0; k < 16; ++k) lines += nl[k], delims += dl[k];
      for (; j < n; ++j) lines += p[i + j] == '\n', delims += p[i + j] == delim;
      i += n;
    }
    if (size && p[size - 1] == '\n') lines -= 1;     // counted below
    if (std::memchr(p, '\r', size))                  // lone "\r" ends a line too
      for (size_t i = 0; i + 1 < size; ++i) lines += (p[i] == '\r') & (p[i + 1] != '\n');
    if (size) lines += 1;   // the last byte: a terminator, or the end of an unterminated line
    if (ncols == 1) return lines;
    return std::min(lines, delims / (ncols - 1));
  }

  // Out-of-range numbers (1e400, 1e-400): what strtod makes of them, in the C locale.
  static double out_of_range(const char* s, const char* e) {
    static locale_t c_locale = newlocale(LC_ALL_MASK, "C", nullptr);
    std::string text(s, e);
    return strtod_l(text.c_str(), nullptr, c_locale);
  }

  static bool word(const char* p, const char* e, const char* w) {
    size_t n = std::strlen(w);
    return static_cast<size_t>(e - p) == n && std::memcmp(p, w, n) == 0;
  }

  // The number in the field [s, e) (blanks already trimmed, not empty); false if none.
  static bool number(const char* s, const char* e, double& value) {
    const char* p = s;
    if (*p == '+') {
      ++p;
      if (p == e || *p == '-' || *p == '+') return false;
    }
    const char* t = *p == '-' ? p + 1 : p;
    if (t < e && (*t == 'n' || *t == 'N')) return false;     // nan is not a number here
    auto [ptr, ec] = std::from_chars(p, e, value, std::chars_format::general);
    if (ptr != e) {
      if (word(s, e, "True") || word(s, e, "TRUE") || word(s, e, "true")) {
        value = 1.0;
        return true;
      }
      if (word(s, e, "False") || word(s, e, "FALSE") || word(s, e, "false")) {
        value = 0.0;
        return true;
      }
      return false;
    }
    if (ec == std::errc::result_out_of_range)
      value = out_of_range(p, e);
    else if (ec != std::errc())
      return false;
    return true;
  }

  // The common case quickly: [sign] digits [. digits] [e [sign] digits] of at most 19
  // significant digits and a value exact in a double, scaled by an exact power of ten
  // (Clinger's fast path: correctly rounded, as from_chars). Sets value and returns the
  // end of the number; nullptr when the text is anything else (the general path decides).
  static const char* quick_number(const char* p, const char* end, double& value) {
    static const double powers[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                    1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                    1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
    bool negative = false;
    if (p < end && (*p == '-' || *p == '+')) negative = *p++ == '-';
    uint64_t mantissa = 0;
    int digits = 0, scale = 0;
    const char* start = p;
    while (p < end && static_cast<unsigned>(*p - '0') < 10) {
      mantissa = mantissa * 10 + (*p++ - '0');
      ++digits;
    }
    bool any = p != start;
    if (p < end && *p == '.') {
      const char* frac = ++p;
      while (p < end && static_cast<unsigned>(*p - '0') < 10) {
        mantissa = mantissa * 10 + (*p++ - '0');
        ++digits;
      }
      scale = static_cast<int>(frac - p);
      any = any || p != frac;
    }
    if (!any || digits > 19) return nullptr;
    if (p < end && (*p == 'e' || *p == 'E')) {
      ++p;
      bool minus = false;
      if (p < end && (*p == '-' || *p == '+')) minus = *p++ == '-';
      const char* exp = p;
      int e = 0;
      while (p < end && static_cast<unsigned>(*p - '0') < 10 && p - exp < 4)
        e = e * 10 + (*p++ - '0');
      if (p == exp || (p < end && static_cast<unsigned>(*p - '0') < 10)) return nullptr;
      scale += minus ? -e : e;
    }
    if (mantissa > (uint64_t(1) << 53) || scale < -22 || scale > 22) return nullptr;
    double m = static_cast<double>(mantissa);
    value = scale < 0 ? m / powers[-scale] : m * powers[scale];
    if (negative) value = -value;
    return p;
  }

  // The closing quote of the quoted field opening at p; sets escaped if the content holds
  // a doubled quote (a literal one). nullptr if the quote does not close on this line.
  static const char* closing_quote(const char* p, const char* end, bool& escaped) {
    escaped = false;
    for (const char* c = p + 1; c < end; ++c) {
      if (*c == '"') {
        if (c + 1 < end && c[1] == '"') {
          escaped = true;
          ++c;
          continue;
        }
        return c;
      }
      if (*c == '\n' || *c == '\r') return nullptr;
    }
    return nullptr;
  }

  // Parse [p, end) into out (``bound`` = max_rows(p, end) rows of nout floats); the rows,
  // -1 and bad, or -2 for a quoted field that does not close on its line (for pandas).
  // A line that starts when ``bound`` rows are done is bad (too few delimiters or lines
  // left for it): it goes to a scratch row until found out.
  int64_t run(const char* p, const char* end, float* out, int64_t bound, BadLine& bad) const {
    if (end - p >= 3 && std::memcmp(p, "\xEF\xBB\xBF", 3) == 0) p += 3;
    int64_t rows = 0, line = 0;
    std::vector<float> scratch(nout);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    while (p < end) {
      const char* q = p;
      while (q < end && is_blank(*q)) ++q;
      if (q == end || *q == '\n' || *q == '\r') {     // a blank line
        p = q;
      } else {
        float* row = rows < bound ? out + rows * nout : scratch.data();
        int column = 0, bad_column = -1;
        const char* bad_field = nullptr;
        size_t bad_len = 0;
        const char* field = p;      // start of the current field, untrimmed
        for (;;) {
          int k = column < ncols ? slot[column] : -1;
          double value;
          const char* stop = k >= 0 ? quick_number(p, end, value) : nullptr;
          if (stop && (stop == end || ends_field(*stop))) {
            row[k] = static_cast<float>(value);
            p = stop;
          } else if (k >= 0 && p < end && *p == '"') {     // a quoted field
            bool escaped;
            const char* close = closing_quote(p, end, escaped);
            if (!close) return -2;
            const char* e = close + 1;
            while (e < end && !ends_field(*e)) ++e;
            const char* tail = close + 1;
            while (tail < e && is_blank(*tail)) ++tail;
            const char* s = p + 1;
            const char* f = close;
            if (s == f && tail == e) {
              row[k] = nan;                         // ""
            } else {
              while (s < f && is_space(*s)) ++s;      // inside quotes even if the delimiter
              while (f > s && is_space(f[-1])) --f;
              if (s < f && tail == e && !escaped && number(s, f, value))
                row[k] = static_cast<float>(value);
              else if (bad_column < 0)
                bad_column = column, bad_field = field, bad_len = e - field;
            }
            p = e;
          } else if (k >= 0) {
            const char* s = p;
            while (s < end && is_blank(*s)) ++s;
            const char* e = s;
            while (e < end && !ends_field(*e)) ++e;
            const char* f = e;
            while (f > s && is_blank(f[-1])) --f;
            if (s == f) {
              if (s == field && e == field) {
                row[k] = nan;                       // an empty field
              } else if (bad_column < 0) {          // blanks only: not a number (pandas)
                bad_column = column, bad_field = field, bad_len = e - field;
              }
            } else if (number(s, f, value)) {
              row[k] = static_cast<float>(value);
            } else if (bad_column < 0) {
              bad_column = column, bad_field = field, bad_len = e - field;
            }
            p = e;
          } else {
            if (p < end && *p == '"') {
              bool escaped;
              const char* close = closing_quote(p, end, escaped);
              if (!close) return -2;
              p = close + 1;
            }
            while (p < end && !ends_field(*p)) ++p;
          }
          ++column;
          if (p < end && *p == delim) {
            field = ++p;
            continue;
          }
          break;
        }
        if (column != ncols || bad_column >= 0) {
          bad.line = line;
          bad.fields = column;
          if (column == ncols) {
            bad.column = bad_column;
            bad.field = bad_field;
            bad.field_len = bad_len;
          }
          return -1;
        }
        for (const auto& c : copies) row[c.first] = row[c.second];
        ++rows;
      }
      if (p < end) {                                // the line terminator
        if (*p == '\r') {
          ++p;
          if (p < end && *p == '\n') ++p, ++line;
        } else {
          ++p, ++line;
        }
      }
    }
    return rows;
  }
};

py::tuple parse(py::buffer data, int delimiter, int ncols, const std::vector<int>& columns) {
  if (delimiter < 0 || delimiter > 255 || delimiter == '\n' || delimiter == '\r' ||
      delimiter == '"')
    throw py::value_error("delimiter must be one byte other than a quote or line break");
  if (ncols < 1) throw py::value_error("ncols must be positive");
  for (int c : columns)
    if (c < 0 || c >= ncols) throw py::value_error("column out of range");
  py::buffer_info info = data.request();
  if (info.ndim != 1 || info.itemsize != 1)
    throw py::value_error("data must be a bytes-like object");
  const char* begin = static_cast<const char*>(info.ptr);
  const char* end = begin + info.size;

  Parser parser(static_cast<char>(delimiter), ncols, columns);
  const py::ssize_t nout = static_cast<py::ssize_t>(columns.size());
  int64_t bound;
  {
    py::gil_scoped_release release;
    bound = parser.max_rows(begin, end);
  }
  py::array_t<float> values({static_cast<py::ssize_t>(bound), nout});
  float* out = values.mutable_data();
  BadLine bad;
  int64_t rows;
  {
    py::gil_scoped_release release;
    rows = parser.run(begin, end, out, bound, bad);
  }
  if (rows == -2) return py::make_tuple(py::none(), py::none());
  if (rows < 0) {
    py::bytes field(bad.field ? bad.field : "", bad.field_len);
    return py::make_tuple(py::none(),
                          py::make_tuple(bad.line, bad.column, bad.fields, field));
  }
  if (rows < bound) values.resize({static_cast<py::ssize_t>(rows), nout});
  return py::make_tuple(values, py::none());
}

}  // namespace

PYBIND11_MODULE(_matex_csvparse, m) {
  m.doc() = "Numeric CSV blocks to float32 rows (matex.readers' native parser).";
  m.def("parse", &parse, py::arg("data"), py::arg("delimiter"), py::arg("ncols"),
        py::arg("columns"),
        "(float32 rows of the selected columns, None), or (None, (line, column or -1, "
        "fields, field bytes)) for the first bad line. Releases the GIL while parsing.");
}
