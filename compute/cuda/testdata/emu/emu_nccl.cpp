// emu_nccl.cpp: a CPU stand-in for NCCL 2, exported under libnccl.so.2's
// names, for the ranks of a group on one machine: separate processes (each
// with its own emulated device), or threads of one process. It is no
// collective algorithm: the ranks exchange their buffers through a
// shared-memory segment (a file in /dev/shm, else in $TMPDIR, mapped by
// each rank; opened as a file, not with shm_open, which older glibcs keep
// in librt) and each computes its result from all of them.
//
// The unique id carries the segment's path
// ("/dev/shm/distill-nccl-<pid>-<n>-<r>"): ncclGetUniqueId makes the
// segment (a zeroed header), ncclCommInitRank opens it, and rank 0 unlinks
// it once every rank has joined (a failing rank unlinks it too), so a
// finished group leaves nothing behind; an id never joined leaves its
// 8 KiB header until reboot. Layout:
//
//	[header: Shared, 8 KiB][staging: 2 halves x nranks slots x slot_bytes]
//
// The operations run when they are enqueued (the emulator runs all stream
// work at once; emu.cpp's stream-order checks see the buffers each reads
// and writes on its stream), in steps: each rank puts
// a chunk of its data in its slot of one half, arrives at the step (a
// barrier: arrived[rank] = step, futex wake), waits for every rank to
// arrive, checks that all ranks issued the same operation (kind, count,
// type, reduction, root: a mismatch is ncclInvalidUsage on every rank, so
// the calls' counts, types and order are checked across ranks), and reads
// the others' chunks. Halves alternate between steps, so a slot is never
// rewritten while a slower rank still reads it. Sums run in rank order,
// ((r0 + r1) + r2)..., in fp32, so results do not depend on timing.
// DISTILL_EMU_NCCL_SLOT_BYTES (read by ncclGetUniqueId; default 256 KiB,
// at least 256) sizes the slots: the tests shrink it to cross many steps.
//
// Failures are errors, never hangs: a wrong size or a rank joining twice
// fails every rank of the group at once (ncclInvalidUsage); a wait for a
// peer ends when the peer's process has exited (ncclRemoteError), or after
// DISTILL_NCCL_TIMEOUT (a Go duration or seconds; default 10 minutes),
// and the first rank to fail marks the group failed, with why, so that
// the others fail at once too. Buffers are checked against the emulator's
// allocations (emu_range_ok). ncclGetLastError gives the details.
//
// Data types: ncclFloat32 for every operation, and ncclBfloat16 (2-byte
// elements, moved as they are) for ncclAllGather, which ZeRO stage 3
// gathers the GEMM weights' BF16 roundings with.
//
// Threads of one process: each rank has its own mapping and communicator,
// and the futexes are process-shared, so that works; but the rest of the
// emulator (allocations, kernels) is single-threaded, so ranks that are
// threads of one process may run only collectives concurrently.
#include "emu.h"
#include "emu_strf.h"

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

namespace {

typedef int ncclResult_t;
enum {
	ncclSuccess = 0,
	ncclSystemError = 2,
	ncclInternalError = 3,
	ncclInvalidArgument = 4,
	ncclInvalidUsage = 5,
	ncclRemoteError = 6,
	ncclInProgress = 7,
};
enum { ncclFloat32 = 7, ncclBfloat16 = 9, ncclSum = 0 };
enum { OP_ALLREDUCE = 1, OP_REDUCESCATTER, OP_ALLGATHER, OP_BROADCAST };

const int kMaxRanks = 64;
const char kMagic[8] = "DKNCCL1";
const size_t kHeaderBytes = 8192;

// Desc is one rank's current operation, compared across ranks at each step.
struct Desc {
	u64 op_no; // the communicator's operation count
	i32 op, dtype, redop, root;
	u64 count;
};

// Shared is the segment's header; all zero when made, which is its initial
// state. Fields are accessed with __atomic builtins.
struct Shared {
	char magic[8];
	u32 slot_bytes; // set by ncclGetUniqueId
	u32 nranks;     // set by the first rank to join
	u32 joined;     // ranks joined (a futex word)
	u32 gen;        // bumped at every arrival (a futex word)
	u32 failed;     // 1: being written, 2: why[] holds why the group failed
	u32 claimed[kMaxRanks];
	i32 pid[kMaxRanks];
	u64 arrived[kMaxRanks]; // the last step each rank arrived at
	Desc desc[2][kMaxRanks];
	char why[1024];
};
static_assert(sizeof(Shared) <= kHeaderBytes, "header too large");

struct Comm {
	int rank, nranks;
	Shared *sh;
	size_t maplen;
	unsigned char *stage;
	size_t slot;
	u64 step, ops;
	double timeout;
	ncclResult_t err; // sticky: the error that broke the communicator
	std::string msg;
	char name[120];
};

thread_local std::string t_last; // ncclGetLastError
thread_local int t_group;         // ncclGroupStart depth

ncclResult_t fail(ncclResult_t code, const std::string &msg) {
	t_last = msg;
	fprintf(stderr, "emu: nccl: %s\n", msg.c_str());
	return code;
}

template <class T> T load(const T *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
template <class T> void store(T *p, T v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

void futex_wake(u32 *w) { syscall(SYS_futex, w, FUTEX_WAKE, 0x7fffffff, nullptr, nullptr, 0); }
void futex_wait(u32 *w, u32 v, double seconds) {
	timespec ts;
	ts.tv_sec = (time_t)seconds;
	ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
	syscall(SYS_futex, w, FUTEX_WAIT, v, &ts, nullptr, 0);
}

double now() {
	timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

// timeout_seconds parses DISTILL_EMU_NCCL_TIMEOUT, else
// DISTILL_NCCL_TIMEOUT, as Go's ParseDuration does ("90s", "1m30s",
// "500ms") or as seconds ("90"); 600 when unset or unreadable. (The first
// lets a test make the stand-in wait longer than JoinCollective does.)
double timeout_seconds() {
	const char *v = getenv("DISTILL_EMU_NCCL_TIMEOUT");
	if (!v || !*v) v = getenv("DISTILL_NCCL_TIMEOUT");
	if (!v || !*v) return 600;
	char *end;
	double plain = strtod(v, &end);
	if (*end == 0) return plain > 0 ? plain : 600;
	double total = 0;
	const char *p = v;
	while (*p) {
		double x = strtod(p, &end);
		if (end == p) return 600;
		p = end;
		static const struct {
			const char *unit;
			double s;
		} units[] = {{"ns", 1e-9}, {"us", 1e-6}, {"µs", 1e-6}, {"ms", 1e-3}, {"s", 1}, {"m", 60}, {"h", 3600}};
		bool found = false;
		for (auto &u : units) {
			size_t n = strlen(u.unit);
			if (strncmp(p, u.unit, n) == 0 && !(n == 1 && p[0] == 'm' && p[1] == 's')) {
				total += x * u.s;
				p += n;
				found = true;
				break;
			}
		}
		if (!found) return 600;
	}
	return total > 0 ? total : 600;
}

std::string seconds_str(double s) { return s < 1 ? strf("%gms", s * 1e3) : strf("%gs", s); }

// alive reports whether process pid runs (not exited, not a zombie).
bool alive(int pid) {
	if (kill(pid, 0) != 0 && errno == ESRCH) return false;
	char path[64], buf[256];
	snprintf(path, sizeof path, "/proc/%d/stat", pid);
	FILE *f = fopen(path, "r");
	if (!f) return true;
	size_t n = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	buf[n] = 0;
	const char *rp = strrchr(buf, ')');
	return !(rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X'));
}

// fail_group marks the group failed with why (the first failure wins),
// wakes every waiter, and makes c's error sticky.
ncclResult_t fail_group(Comm *c, Shared *sh, ncclResult_t code, const std::string &why) {
	u32 zero = 0;
	if (__atomic_compare_exchange_n(&sh->failed, &zero, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
		snprintf(sh->why, sizeof sh->why, "%s", why.c_str());
		store(&sh->failed, 2u);
	}
	__atomic_add_fetch(&sh->gen, 1, __ATOMIC_ACQ_REL);
	__atomic_add_fetch(&sh->joined, 1u << 16, __ATOMIC_ACQ_REL); // joined's high half: wakes the join wait
	futex_wake(&sh->gen);
	futex_wake(&sh->joined);
	if (c) {
		c->err = code;
		c->msg = why;
	}
	return fail(code, why);
}

// group_failure returns why the group failed (another rank said so).
std::string group_failure(Shared *sh) {
	for (int i = 0; i < 1000 && load(&sh->failed) != 2; i++) usleep(1000);
	return load(&sh->failed) == 2 ? std::string(sh->why) : std::string("another rank failed");
}

// wait_until waits on futex word w until ready() holds. It fails when the
// group fails, when a rank it waits for (waiting(q)) has exited, and after
// the timeout; what names the wait in messages.
template <class Ready, class Waiting>
ncclResult_t wait_until(Comm *c, Shared *sh, int rank, int nranks, double timeout, u32 *w, Ready ready, Waiting waiting,
                        const std::string &what) {
	double t0 = now(), lastCheck = t0;
	for (;;) {
		u32 v = load(w);
		if (ready()) return ncclSuccess;
		if (load(&sh->failed)) {
			std::string why = group_failure(sh);
			if (c) {
				c->err = ncclRemoteError;
				c->msg = "the group failed: " + why;
			}
			return fail(ncclRemoteError, strf("rank %d: the group failed: %s", rank, why.c_str()));
		}
		double t = now();
		std::string missing;
		if (t - lastCheck > 0.2 || t - t0 >= timeout) {
			lastCheck = t;
			for (int q = 0; q < nranks; q++) {
				if (!waiting(q)) continue;
				int pid = load(&sh->pid[q]);
				if (pid > 0 && pid != getpid() && !alive(pid))
					return fail_group(c, sh, ncclRemoteError,
					                  strf("rank %d (pid %d) exited while rank %d waited for it %s", q, pid, rank, what.c_str()));
				missing += (missing.empty() ? "" : ", ") + std::to_string(q);
			}
		}
		if (t - t0 >= timeout)
			return fail_group(c, sh, ncclRemoteError,
			                  strf("rank %d timed out after %s (DISTILL_NCCL_TIMEOUT) waiting for rank(s) %s %s", rank,
			                       seconds_str(timeout).c_str(), missing.c_str(), what.c_str()));
		double left = timeout - (t - t0);
		futex_wait(w, v, left < 0.1 ? left : 0.1);
	}
}

const char *op_name(int op) {
	switch (op) {
	case OP_ALLREDUCE: return "ncclAllReduce";
	case OP_REDUCESCATTER: return "ncclReduceScatter";
	case OP_ALLGATHER: return "ncclAllGather";
	case OP_BROADCAST: return "ncclBroadcast";
	}
	return "?";
}

std::string desc_str(const Desc &d) {
	std::string s = strf("operation #%llu %s of %llu elements of type %d", (unsigned long long)d.op_no, op_name(d.op),
	                     (unsigned long long)d.count, d.dtype);
	if (d.op == OP_ALLREDUCE || d.op == OP_REDUCESCATTER) s += strf(", reduction %d", d.redop);
	if (d.op == OP_BROADCAST) s += strf(", root %d", d.root);
	return s;
}

bool same(const Desc &a, const Desc &b) {
	return a.op_no == b.op_no && a.op == b.op && a.dtype == b.dtype && a.redop == b.redop && a.root == b.root && a.count == b.count;
}

float *slot_of(Comm *c, int half, int q) { return (float *)(c->stage + ((size_t)half * c->nranks + q) * c->slot); }

// sum_ranks writes out[i] = the sum over ranks, in rank order, of element
// at + i of their slots in half, for i < n.
void sum_ranks(Comm *c, int half, size_t at, float *out, size_t n) {
	for (size_t i = 0; i < n; i++) {
		float acc = slot_of(c, half, 0)[at + i];
		for (int q = 1; q < c->nranks; q++) acc += slot_of(c, half, q)[at + i];
		out[i] = acc;
	}
}

// collective runs operation d in steps of chunk elements: put(mine, off,
// n) fills this rank's slot with its part of elements [off, off+n), then,
// once every rank has arrived, get(half, off, n) reads them all.
template <class Put, class Get> ncclResult_t collective(Comm *c, Desc d, size_t chunk, Put put, Get get) {
	Shared *sh = c->sh;
	size_t steps = d.count == 0 ? 1 : (d.count + chunk - 1) / chunk;
	for (size_t k = 0; k < steps; k++) {
		u64 s = ++c->step;
		int half = (int)(s & 1);
		size_t off = k * chunk, n = d.count == 0 ? 0 : (d.count - off < chunk ? d.count - off : chunk);
		sh->desc[half][c->rank] = d;
		put(slot_of(c, half, c->rank), off, n);
		store(&sh->arrived[c->rank], s);
		__atomic_add_fetch(&sh->gen, 1, __ATOMIC_ACQ_REL);
		futex_wake(&sh->gen);
		std::string what = strf("at step %llu of %s", (unsigned long long)s, desc_str(d).c_str());
		ncclResult_t r = wait_until(
		    c, sh, c->rank, c->nranks, c->timeout, &sh->gen,
		    [&] {
			    for (int q = 0; q < c->nranks; q++)
				    if (load(&sh->arrived[q]) < s) return false;
			    return true;
		    },
		    [&](int q) { return load(&sh->arrived[q]) < s; }, what);
		if (r != ncclSuccess) return r;
		for (int q = 0; q < c->nranks; q++)
			if (!same(sh->desc[half][q], d))
				return fail_group(c, sh, ncclInvalidUsage,
				                  strf("ranks disagree: rank %d issued %s, rank %d issued %s", c->rank, desc_str(d).c_str(), q,
				                       desc_str(sh->desc[half][q]).c_str()));
		get(half, off, n);
	}
	return ncclSuccess;
}

// begin checks what every operation needs: a live communicator, fp32
// (or, where bf16 is set, ncclBfloat16 too), sum, buffers inside
// allocations. A failure fails the group, so that the peers do not wait
// for this rank.
ncclResult_t begin(Comm *c, const char *call, int dtype, int redop, const void *send, size_t sendBytes, const void *recv,
                   size_t recvBytes, void *stream, bool bf16 = false) {
	if (!c) return fail(ncclInvalidArgument, strf("%s: comm is NULL", call));
	if (c->err != ncclSuccess) return fail(ncclInvalidUsage, strf("%s: the communicator failed earlier: %s", call, c->msg.c_str()));
	if (dtype != ncclFloat32 && !(bf16 && dtype == ncclBfloat16))
		return fail_group(c, c->sh, ncclInvalidArgument,
		                  strf("rank %d: %s: data type %d is not emulated (only ncclFloat32, 7%s)", c->rank, call, dtype,
		                       bf16 ? ", and ncclBfloat16, 9" : ""));
	if (redop != ncclSum)
		return fail_group(c, c->sh, ncclInvalidArgument, strf("rank %d: %s: reduction %d is not emulated (only ncclSum, 0)", c->rank, call, redop));
	char why[300];
	if (!emu_range_ok((u64)send, sendBytes, why, sizeof why))
		return fail_group(c, c->sh, ncclInvalidArgument, strf("rank %d: %s: sendbuff: %s", c->rank, call, why));
	if (!emu_range_ok((u64)recv, recvBytes, why, sizeof why))
		return fail_group(c, c->sh, ncclInvalidArgument, strf("rank %d: %s: recvbuff: %s", c->rank, call, why));
	// Stream order (emu.cpp): sendbuff read, recvbuff written, on stream.
	char rwhy[600];
	if ((sendBytes > 0 && !emu_stream_access(stream, (u64)send, false, call, rwhy, sizeof rwhy)) ||
	    (recvBytes > 0 && !emu_stream_access(stream, (u64)recv, true, call, rwhy, sizeof rwhy)))
		return fail_group(c, c->sh, ncclInvalidUsage, strf("rank %d: %s", c->rank, rwhy));
	c->ops++;
	return ncclSuccess;
}

std::atomic_uint g_ids;

// seg_dir is where segments go: /dev/shm (a tmpfs) where it is writable,
// else $TMPDIR, else /tmp.
std::string seg_dir() {
	struct stat st;
	if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK) == 0) return "/dev/shm";
	const char *t = getenv("TMPDIR");
	return t && *t ? t : "/tmp";
}

} // namespace

extern "C" {

ncclResult_t ncclGetVersion(int *v) {
	*v = 29900; // "2.99.0": the emulator
	return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
	switch (r) {
	case ncclSuccess: return "no error";
	case 1: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
	case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
	case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
	case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
	case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
	case ncclRemoteError: return "remote process exited or there was a network error";
	case ncclInProgress: return "NCCL operation in progress";
	}
	return "unknown result code";
}

const char *ncclGetLastError(void *) { return t_last.c_str(); }

ncclResult_t ncclGetUniqueId(char *id) {
	char name[120];
	int len = snprintf(name, sizeof name, "%s/distill-nccl-%d-%u-%08lx", seg_dir().c_str(), (int)getpid(), g_ids.fetch_add(1),
	                   (unsigned long)(now() * 1e9) & 0xffffffffUL);
	if (len < 0 || len >= (int)sizeof name)
		return fail(ncclSystemError, strf("ncclGetUniqueId: the segment's path in %s is longer than an id holds (%zu bytes): set TMPDIR shorter",
		                                  seg_dir().c_str(), sizeof name - 1));
	int fd = open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
	if (fd < 0) return fail(ncclSystemError, strf("ncclGetUniqueId: creating %s: %s", name, strerror(errno)));
	if (ftruncate(fd, kHeaderBytes) != 0) {
		int e = errno;
		close(fd);
		unlink(name);
		return fail(ncclSystemError, strf("ncclGetUniqueId: ftruncate(%s): %s", name, strerror(e)));
	}
	void *m = mmap(nullptr, kHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED) {
		unlink(name);
		return fail(ncclSystemError, strf("ncclGetUniqueId: mmap(%s): %s", name, strerror(errno)));
	}
	Shared *sh = (Shared *)m;
	const char *v = getenv("DISTILL_EMU_NCCL_SLOT_BYTES");
	size_t slot = v && *v ? (size_t)strtoull(v, nullptr, 10) : 256 << 10;
	if (slot < 256) slot = 256;
	sh->slot_bytes = (u32)(slot / 4 * 4);
	memcpy(sh->magic, kMagic, sizeof kMagic);
	munmap(m, kHeaderBytes);
	memset(id, 0, 128);
	memcpy(id, kMagic, sizeof kMagic);
	memcpy(id + 8, name, strlen(name) + 1);
	return ncclSuccess;
}

// ncclUniqueId is 128 bytes passed by value: as a struct here too.
struct emu_nccl_id {
	char internal[128];
};

ncclResult_t ncclCommInitRank(void **out, int nranks, emu_nccl_id id, int rank) {
	*out = nullptr;
	if (memcmp(id.internal, kMagic, sizeof kMagic) != 0)
		return fail(ncclInvalidArgument, "ncclCommInitRank: the id was not made by the emulator's ncclGetUniqueId");
	if (nranks < 1 || nranks > kMaxRanks)
		return fail(ncclInvalidArgument, strf("ncclCommInitRank: %d ranks: the emulator takes 1 to %d", nranks, kMaxRanks));
	if (rank < 0 || rank >= nranks) return fail(ncclInvalidArgument, strf("ncclCommInitRank: rank %d of %d", rank, nranks));
	char name[120];
	memcpy(name, id.internal + 8, sizeof name);
	name[sizeof name - 1] = 0;
	int fd = open(name, O_RDWR | O_CLOEXEC);
	if (fd < 0) {
		if (errno == ENOENT)
			return fail(ncclInvalidUsage, strf("ncclCommInitRank: rank %d of %d: the group of this id (%s) has formed or failed already, or the id was made on another machine",
			                                   rank, nranks, name));
		return fail(ncclSystemError, strf("ncclCommInitRank: opening %s: %s", name, strerror(errno)));
	}
	void *m = mmap(nullptr, kHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (m == MAP_FAILED) {
		int e = errno;
		close(fd);
		return fail(ncclSystemError, strf("ncclCommInitRank: mmap(%s): %s", name, strerror(e)));
	}
	Shared *sh = (Shared *)m;
	auto give_up = [&](ncclResult_t r) {
		unlink(name);
		munmap(m, kHeaderBytes);
		close(fd);
		return r;
	};
	if (load(&sh->failed)) return give_up(fail(ncclRemoteError, strf("ncclCommInitRank: rank %d: the group failed: %s", rank, group_failure(sh).c_str())));
	u32 expect = 0;
	if (!__atomic_compare_exchange_n(&sh->nranks, &expect, (u32)nranks, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) && expect != (u32)nranks)
		return give_up(fail_group(nullptr, sh, ncclInvalidUsage,
		                          strf("rank %d joined a group of %d ranks, but an earlier rank joined it as a group of %u", rank, nranks, expect)));
	u32 zero = 0;
	if (!__atomic_compare_exchange_n(&sh->claimed[rank], &zero, 1u, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
		return give_up(fail_group(nullptr, sh, ncclInvalidUsage,
		                          strf("rank %d of %d joined twice (pids %d and %d)", rank, nranks, (int)load(&sh->pid[rank]), (int)getpid())));
	store(&sh->pid[rank], (i32)getpid());
	size_t slot = sh->slot_bytes;
	size_t len = kHeaderBytes + 2 * (size_t)nranks * slot;
	if (ftruncate(fd, (off_t)len) != 0)
		return give_up(fail_group(nullptr, sh, ncclSystemError, strf("rank %d: ftruncate(%s, %zu): %s", rank, name, len, strerror(errno))));
	void *full = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (full == MAP_FAILED)
		return give_up(fail_group(nullptr, sh, ncclSystemError, strf("rank %d: mmap(%s, %zu): %s", rank, name, len, strerror(errno))));
	close(fd);
	munmap(m, kHeaderBytes);
	sh = (Shared *)full;
	Comm *c = new Comm{};
	c->rank = rank;
	c->nranks = nranks;
	c->sh = sh;
	c->maplen = len;
	c->stage = (unsigned char *)full + kHeaderBytes;
	c->slot = slot;
	c->timeout = timeout_seconds();
	snprintf(c->name, sizeof c->name, "%s", name);
	__atomic_add_fetch(&sh->joined, 1, __ATOMIC_ACQ_REL);
	futex_wake(&sh->joined);
	ncclResult_t r = wait_until(
	    nullptr, sh, rank, nranks, c->timeout, &sh->joined, [&] { return (load(&sh->joined) & 0xffff) == (u32)nranks; },
	    [&](int q) { return load(&sh->claimed[q]) == 0; }, strf("to join (ncclCommInitRank, %s)", name));
	if (r == ncclSuccess && rank == 0) unlink(name);
	if (r != ncclSuccess) {
		unlink(name);
		munmap(full, len);
		delete c;
		return r;
	}
	*out = c;
	return ncclSuccess;
}

ncclResult_t ncclCommDestroy(void *comm) {
	Comm *c = (Comm *)comm;
	if (!c) return fail(ncclInvalidArgument, "ncclCommDestroy: comm is NULL");
	munmap(c->sh, c->maplen);
	delete c;
	return ncclSuccess;
}

// ncclCommAbort fails the group, so that peers waiting for this rank fail
// now rather than at their timeout.
ncclResult_t ncclCommAbort(void *comm) {
	Comm *c = (Comm *)comm;
	if (!c) return ncclSuccess;
	if (!load(&c->sh->failed)) fail_group(c, c->sh, ncclRemoteError, strf("rank %d aborted its communicator", c->rank));
	return ncclCommDestroy(comm);
}

ncclResult_t ncclCommGetAsyncError(void *comm, ncclResult_t *err) {
	Comm *c = (Comm *)comm;
	if (!c) return fail(ncclInvalidArgument, "ncclCommGetAsyncError: comm is NULL");
	*err = c->err;
	return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
	t_group++;
	return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
	if (t_group == 0) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
	t_group--;
	return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, int dtype, int op, void *comm, void *stream) {
	Comm *c = (Comm *)comm;
	if (ncclResult_t r = begin(c, "ncclAllReduce", dtype, op, send, count * 4, recv, count * 4, stream)) return r;
	const float *in = (const float *)send;
	float *out = (float *)recv;
	return collective(
	    c, Desc{c->ops, OP_ALLREDUCE, dtype, op, 0, count}, c->slot / 4,
	    [&](float *mine, size_t off, size_t n) { memcpy(mine, in + off, n * 4); },
	    [&](int half, size_t off, size_t n) { sum_ranks(c, half, 0, out + off, n); });
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, int dtype, int op, void *comm, void *stream) {
	Comm *c = (Comm *)comm;
	if (ncclResult_t r = begin(c, "ncclReduceScatter", dtype, op, send, count * 4 * (c ? c->nranks : 0), recv, count * 4, stream)) return r;
	const float *in = (const float *)send;
	float *out = (float *)recv;
	size_t chunk = c->slot / 4 / c->nranks;
	return collective(
	    c, Desc{c->ops, OP_REDUCESCATTER, dtype, op, 0, count}, chunk,
	    [&](float *mine, size_t off, size_t n) {
		    for (int j = 0; j < c->nranks; j++) memcpy(mine + j * chunk, in + j * count + off, n * 4);
	    },
	    [&](int half, size_t off, size_t n) { sum_ranks(c, half, c->rank * chunk, out + off, n); });
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, int dtype, void *comm, void *stream) {
	Comm *c = (Comm *)comm;
	size_t es = dtype == ncclBfloat16 ? 2 : 4; // (begin refuses any other)
	if (ncclResult_t r = begin(c, "ncclAllGather", dtype, ncclSum, send, count * es, recv, count * es * (c ? c->nranks : 0), stream, true))
		return r;
	const unsigned char *in = (const unsigned char *)send;
	unsigned char *out = (unsigned char *)recv;
	return collective(
	    c, Desc{c->ops, OP_ALLGATHER, dtype, ncclSum, 0, count}, c->slot / es,
	    [&](float *mine, size_t off, size_t n) { memcpy(mine, in + off * es, n * es); },
	    [&](int half, size_t off, size_t n) {
		    for (int q = 0; q < c->nranks; q++) memmove(out + (q * count + off) * es, slot_of(c, half, q), n * es);
	    });
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, int dtype, int root, void *comm, void *stream) {
	Comm *c = (Comm *)comm;
	if (c && (root < 0 || root >= c->nranks))
		return fail_group(c, c->sh, ncclInvalidArgument, strf("rank %d: ncclBroadcast from root %d of %d", c->rank, root, c->nranks));
	if (ncclResult_t r = begin(c, "ncclBroadcast", dtype, ncclSum, send, c && c->rank == root ? count * 4 : 0, recv, count * 4, stream)) return r;
	const float *in = (const float *)send;
	float *out = (float *)recv;
	return collective(
	    c, Desc{c->ops, OP_BROADCAST, dtype, ncclSum, root, count}, c->slot / 4,
	    [&](float *mine, size_t off, size_t n) {
		    if (c->rank == root) memcpy(mine, in + off, n * 4);
	    },
	    [&](int half, size_t off, size_t n) {
		    if (c->rank != root || out != in) memmove(out + off, slot_of(c, half, root), n * 4);
	    });
}

} // extern "C"
