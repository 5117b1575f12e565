// Environment switches read by the C++ kernels, with the words sglang_dflash/settings.py accepts
// (the registry that declares every switch): on is 1, true, yes or on; off is 0, false, no or
// off; any case, surrounding whitespace ignored; unset or empty is the default; anything else is
// an error naming the variable, not a guess. Host code only.
#pragma once

#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace sglang_dflash {

// The variable's text without surrounding whitespace, lower case ("" when unset).
inline std::string env_text(const char* name) {
  const char* raw = std::getenv(name);
  std::string text = raw == nullptr ? "" : raw;
  const char* space = " \t\n\r\f\v";
  const auto first = text.find_first_not_of(space);
  text = first == std::string::npos ? "" : text.substr(first, text.find_last_not_of(space) - first + 1);
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

inline bool env_flag(const char* name, bool fallback) {
  const std::string text = env_text(name);
  const char* raw = std::getenv(name);
  if (text.empty()) return fallback;
  if (text == "1" || text == "true" || text == "yes" || text == "on") return true;
  if (text == "0" || text == "false" || text == "no" || text == "off") return false;
  throw std::invalid_argument(std::string(name) + "='" + raw +
                              "': expected 1, true, yes, on (on) or 0, false, no, off (off)");
}

// A whole decimal integer, or `fallback` when unset or empty; anything else is an error naming it.
inline long long env_int(const char* name, long long fallback) {
  const std::string text = env_text(name);
  if (text.empty()) return fallback;
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size()) throw std::invalid_argument(std::string(name) + "='" + text + "': expected an integer");
  return value;
}

}  // namespace sglang_dflash
