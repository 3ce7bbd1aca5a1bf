// emu_strf.h: printf into a std::string, for the messages of the library
// stand-ins (emu_cudnn.cpp, emu_nccl.cpp).
#pragma once
#include <cstdarg>
#include <cstdio>
#include <string>

static inline std::string strf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline std::string strf(const char *fmt, ...) {
	char buf[4096];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof buf, fmt, ap);
	va_end(ap);
	return buf;
}
