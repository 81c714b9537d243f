// Software conversions between 16-bit floats and float32, so the core needs
// neither TensorFlow's nor a compiler's half types.
#ifndef MATEX_HALF_H_
#define MATEX_HALF_H_

#include <cstdint>
#include <cstring>

namespace matex {
namespace half {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// bfloat16 is the upper half of a float32; round to nearest even, keep NaN.
inline float BFloat16ToFloat(uint16_t h) { return BitsFloat(uint32_t(h) << 16); }

inline uint16_t FloatToBFloat16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// IEEE 754 binary16.
inline float Float16ToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (man << 13));  // inf/NaN
  if (exp == 0) {
    if (man == 0) return BitsFloat(sign);
    // Subnormal: value = man * 2^-24.
    float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return BitsFloat(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t FloatToFloat16(float f) {
  uint32_t u = FloatBits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {
    // Result is subnormal or zero: round abs / 2^-24 to nearest even.
    float v = BitsFloat(abs) * 16777216.0f;
    uint32_t m = uint32_t(v);
    float rem = v - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  // Normal: rebias exponent, round mantissa to nearest even.
  uint32_t r = abs - 0x38000000u;
  r += 0x0fffu + ((r >> 13) & 1u);
  return uint16_t(sign | (r >> 13));
}

}  // namespace half
}  // namespace matex

#endif  // MATEX_HALF_H_
