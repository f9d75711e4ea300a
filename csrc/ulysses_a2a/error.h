// The library's error text: one thread-local message behind fvk_last_error() (context.cu), set by every
// failing call of the product and the test library. Host-only C++ (the vote and the host models include it).
#pragma once

namespace fvk {

// Formats the message fvk_last_error() returns and passes `code` through (FVK_ERR_*).
int set_error(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace fvk
