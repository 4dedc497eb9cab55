// A small unit-test framework for the pure parts of the native code.
//
//   TEST(Name) { CHECK(cond); CHECK_EQ(a, b); }
//
// Every TEST registers itself; PERSEUS_TEST_MAIN() defines main(), which runs
// them all, prints each failed check with file:line, and returns non-zero
// when any failed. Checks record the failure and go on.
#pragma once

#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace perseus_test {

struct Case {
  const char* name;
  std::function<void()> body;
};

inline std::vector<Case>& Cases() {
  static std::vector<Case> cases;
  return cases;
}

inline int& Failures() {
  static int failures = 0;
  return failures;
}

struct Register {
  Register(const char* name, std::function<void()> body) { Cases().push_back({name, body}); }
};

inline void Fail(const char* file, int line, const std::string& what) {
  ++Failures();
  std::fprintf(stderr, "%s:%d: check failed: %s\n", file, line, what.c_str());
}

template <typename A, typename B>
void CheckEq(const A& a, const B& b, const char* text, const char* file, int line) {
  if (a == b) return;
  std::ostringstream msg;
  msg << text << " (" << a << " vs " << b << ")";
  Fail(file, line, msg.str());
}

inline int RunAll() {
  for (const Case& c : Cases()) {
    const int before = Failures();
    try {
      c.body();
    } catch (const std::exception& e) {
      Fail(c.name, 0, std::string("unexpected exception: ") + e.what());
    }
    std::printf("%s %s\n", Failures() == before ? "ok  " : "FAIL", c.name);
  }
  std::printf("%zu tests, %d failed checks\n", Cases().size(), Failures());
  return Failures() == 0 ? 0 : 1;
}

}  // namespace perseus_test

#define TEST(name)                                                           \
  static void Test_##name();                                                 \
  static perseus_test::Register name##_registered(#name, Test_##name);       \
  static void Test_##name()

#define CHECK(cond) \
  ((cond) ? (void)0 : perseus_test::Fail(__FILE__, __LINE__, #cond))
#define CHECK_EQ(a, b) perseus_test::CheckEq((a), (b), #a " == " #b, __FILE__, __LINE__)
// The statement must throw std::exception.
#define CHECK_THROWS(stmt)                                                   \
  do {                                                                       \
    bool threw = false;                                                      \
    try {                                                                    \
      stmt;                                                                  \
    } catch (const std::exception&) {                                        \
      threw = true;                                                          \
    }                                                                        \
    if (!threw) perseus_test::Fail(__FILE__, __LINE__, #stmt " did not throw"); \
  } while (0)

#define PERSEUS_TEST_MAIN() \
  int main() { return perseus_test::RunAll(); }
