package cuda

/*
#cgo LDFLAGS: -ldl
#include "capi.h"
#include "nccl_capi.h"
*/
import "C"

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync"
	"time"
	"unsafe"

	"distill/compute"
)

// Collectives through NCCL (issue 25): the backend implements
// compute.Collectives, and the Collective it returns runs NCCL's
// all-reduce, reduce-scatter, all-gather and broadcast on the backend's
// stream, in issue order with the kernels, over its F32 tensors (the
// all-gather over BF16 ones too: ncclBfloat16, NCCL 2.10 and later).
//
// libnccl.so.2 is opened with dlopen the first time a group is made or
// joined (DISTILL_LIBNCCL names the file), and reached through the
// hand-declared prototypes of nccl_capi.h.
//
// Failure semantics. ncclCommInitRank blocks until every rank of the group
// has joined, so JoinCollective runs it on a thread of its own (with the
// backend's context current) and waits at most DISTILL_NCCL_TIMEOUT
// (default 10 minutes, plus a few seconds' grace for the library's own
// error to arrive first); past it, the error names the timeout, and the
// thread left in NCCL aborts the communicator if it ever forms. The
// operations are asynchronous: a failed call panics, as a failed kernel
// launch does, with an *NCCLError. Errors NCCL finds later (a peer's
// connection lost) are polled by a watchdog (ncclCommGetAsyncError,
// every half second), which aborts the communicator (ncclCommAbort), so
// that work hung on the stream returns; the next operation then panics
// with that error. A peer that is alive but never issues the matching
// call hangs the stream, as in NCCL: the launcher's heartbeats (package
// train/dist) end such a job.

// ncclTimeoutDefault is how long a rank waits for its group to form
// without DISTILL_NCCL_TIMEOUT: PyTorch's default for its process groups.
const ncclTimeoutDefault = 10 * time.Minute

// ncclGrace is what JoinCollective waits beyond the timeout, so that a
// library which times out by itself (the emulator's) reports first, with
// its details.
const ncclGrace = 5 * time.Second

// ncclWatchdogPeriod is how often the watchdog asks NCCL for an
// asynchronous error.
const ncclWatchdogPeriod = 500 * time.Millisecond

// nccl is the NCCL library, reached through function pointers.
type nccl struct {
	lib     *library
	version int

	getVersion, getUniqueID, commInitRank, commDestroy, commAbort        unsafe.Pointer
	getErrorString, getLastError, commGetAsyncError                      unsafe.Pointer
	allReduce, reduceScatter, allGather, broadcast, groupStart, groupEnd unsafe.Pointer
}

// ncclLibs holds the libraries loaded so far, by the file asked for
// (DISTILL_LIBNCCL's value, "" for the search): loaded once, kept for the
// process (communicators refer to them). Failures are not kept.
var ncclLibs struct {
	sync.Mutex
	byEnv map[string]*nccl
}

var specNCCL = libSpec{
	what: "NCCL", env: "DISTILL_LIBNCCL", names: []string{"libnccl.so.2"},
	hint: "install NCCL 2 (pip nvidia-nccl-cu12 or -cu13, which PyTorch's wheel ships under site-packages/nvidia/nccl/lib, or the CUDA repository's libnccl2), or point DISTILL_LIBNCCL at libnccl.so.2",
}

// loadNCCL opens libnccl.so.2 (or DISTILL_LIBNCCL) and binds its entry
// points; a missing library or symbol is an error naming it and what to
// do.
func loadNCCL() (*nccl, error) {
	env := os.Getenv(specNCCL.env)
	ncclLibs.Lock()
	defer ncclLibs.Unlock()
	if l := ncclLibs.byEnv[env]; l != nil {
		return l, nil
	}
	lib, err := openLibrary(specNCCL)
	if err != nil {
		return nil, err
	}
	l := &nccl{lib: lib}
	if err := lib.bind(map[string]*unsafe.Pointer{
		"ncclGetVersion":        &l.getVersion,
		"ncclGetUniqueId":       &l.getUniqueID,
		"ncclCommInitRank":      &l.commInitRank,
		"ncclCommDestroy":       &l.commDestroy,
		"ncclCommAbort":         &l.commAbort,
		"ncclGetErrorString":    &l.getErrorString,
		"ncclCommGetAsyncError": &l.commGetAsyncError,
		"ncclAllReduce":         &l.allReduce,
		"ncclReduceScatter":     &l.reduceScatter,
		"ncclAllGather":         &l.allGather,
		"ncclBroadcast":         &l.broadcast,
		"ncclGroupStart":        &l.groupStart,
		"ncclGroupEnd":          &l.groupEnd,
	}); err != nil {
		lib.close()
		return nil, err
	}
	if p, err := lib.sym("ncclGetLastError"); err == nil { // 2.13 and newer: the details of the last failure
		l.getLastError = p
	}
	var v C.int
	if err := l.check("ncclGetVersion", C.call_ncclGetVersion(l.getVersion, &v)); err != nil {
		lib.close()
		return nil, err
	}
	l.version = int(v)
	if ncclLibs.byEnv == nil {
		ncclLibs.byEnv = map[string]*nccl{}
	}
	ncclLibs.byEnv[env] = l
	return l, nil
}

// Version is NCCL's version as a string: 22105 is "2.21.5" (NCCL_VERSION
// codes from 2.9 on; 1000·major + 100·minor + patch before).
func (l *nccl) Version() string {
	v := l.version
	if v >= 20900 {
		return fmt.Sprintf("%d.%d.%d", v/10000, v/100%100, v%100)
	}
	return fmt.Sprintf("%d.%d.%d", v/1000, v/100%10, v%100)
}

// NCCLError is a failed NCCL call: the call, NCCL's ncclResult_t, and
// NCCL's words for it (ncclGetErrorString, and ncclGetLastError's details
// where the library has it). Result 6, ncclRemoteError, is a peer's
// failure (its process exited, its connection dropped).
type NCCLError struct {
	Call   string
	Result int
	Detail string
}

func (e *NCCLError) Error() string {
	return fmt.Sprintf("cuda: %s failed: %s (%d): %s", e.Call, ncclResultName(e.Result), e.Result, e.Detail)
}

// ncclResultName names an ncclResult_t.
func ncclResultName(r int) string {
	names := [...]string{"ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
		"ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress"}
	if r >= 0 && r < len(names) {
		return names[r]
	}
	return "ncclResult(" + strconv.Itoa(r) + ")"
}

// check turns an ncclResult_t into an *NCCLError naming the call (nil on
// success). It runs on the thread of the failed call, where NCCL keeps the
// last error's details.
func (l *nccl) check(call string, r C.ncclResult_t) error {
	if r == C.DK_ncclSuccess {
		return nil
	}
	e := &NCCLError{Call: call, Result: int(r)}
	if s := C.call_ncclGetErrorString(l.getErrorString, r); s != nil {
		e.Detail = C.GoString(s)
	}
	if l.getLastError != nil {
		if s := C.call_ncclGetLastError(l.getLastError, nil); s != nil && *s != 0 {
			e.Detail += ": " + C.GoString(s)
		}
	}
	return e
}

// ncclTimeout is DISTILL_NCCL_TIMEOUT: a Go duration ("90s", "2m") or a
// number of seconds; ncclTimeoutDefault when unset.
func ncclTimeout() (time.Duration, error) {
	v := os.Getenv("DISTILL_NCCL_TIMEOUT")
	if v == "" {
		return ncclTimeoutDefault, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		s, err2 := strconv.ParseFloat(v, 64)
		if err2 != nil {
			return 0, fmt.Errorf("cuda: DISTILL_NCCL_TIMEOUT=%q: want a duration such as 90s or 10m, or seconds", v)
		}
		d = time.Duration(s * float64(time.Second))
	}
	if d <= 0 {
		return 0, fmt.Errorf("cuda: DISTILL_NCCL_TIMEOUT=%q: want a positive duration", v)
	}
	return d, nil
}

var _ compute.Collectives = (*Backend)(nil)

// NewCollectiveID implements compute.Collectives: ncclGetUniqueId. With
// NCCL the id holds the address of a bootstrap listener this process
// starts, so rank 0 (or a process that outlives the group's forming) makes
// it.
func (b *Backend) NewCollectiveID() (compute.CollectiveID, error) {
	var id compute.CollectiveID
	l, err := loadNCCL()
	if err != nil {
		return id, err
	}
	defer b.enter()()
	var cid C.ncclUniqueId
	if err := l.check("ncclGetUniqueId", C.call_ncclGetUniqueId(l.getUniqueID, &cid)); err != nil {
		return id, err
	}
	copy(id[:], C.GoBytes(unsafe.Pointer(&cid), C.int(len(id))))
	return id, nil
}

// JoinCollective implements compute.Collectives: ncclCommInitRank on the
// backend's device (its context current). It returns when every rank has
// joined; a rank that is missing past DISTILL_NCCL_TIMEOUT (default 10
// minutes) makes it an error naming the timeout. The backend's other
// calls wait meanwhile (it holds the backend's mutex, as every call does).
func (b *Backend) JoinCollective(id compute.CollectiveID, rank, size int) (compute.Collective, error) {
	if size < 1 || rank < 0 || rank >= size {
		return nil, fmt.Errorf("cuda: JoinCollective as rank %d of %d: want 0 <= rank < size", rank, size)
	}
	timeout, err := ncclTimeout()
	if err != nil {
		return nil, err
	}
	l, err := loadNCCL()
	if err != nil {
		return nil, err
	}
	defer b.enter()()
	call := fmt.Sprintf("ncclCommInitRank(rank %d of %d)", rank, size)
	type joined struct {
		comm C.ncclComm_t
		err  error
	}
	done := make(chan joined, 1)
	ctx, drv := b.ctx, b.drv
	t0 := time.Now()
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := drv.check("cuCtxSetCurrent", C.call_cuCtxSetCurrent(drv.cuCtxSetCurrent, ctx)); err != nil {
			done <- joined{err: err}
			return
		}
		var cid C.ncclUniqueId
		copy(unsafe.Slice((*byte)(unsafe.Pointer(&cid)), len(id)), id[:])
		var comm C.ncclComm_t
		err := l.check(call, C.call_ncclCommInitRank(l.commInitRank, &comm, C.int(size), &cid, C.int(rank)))
		done <- joined{comm, err}
	}()
	timer := time.NewTimer(timeout + ncclGrace)
	defer timer.Stop()
	select {
	case j := <-done:
		if j.err != nil {
			return nil, j.err
		}
		b.logf("cuda: NCCL %s (%s): rank %d of %d joined in %v", l.Version(), l.lib.path, rank, size, time.Since(t0).Round(time.Millisecond))
		c := &collective{b: b, l: l, rank: rank, size: size, comm: j.comm, stop: make(chan struct{}), stopped: make(chan struct{})}
		go c.watchdog()
		return c, nil
	case <-timer.C:
		// The thread stays in NCCL; should the group ever form, it aborts
		// the communicator nobody holds.
		go func() {
			if j := <-done; j.err == nil {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				C.call_cuCtxSetCurrent(drv.cuCtxSetCurrent, ctx)
				C.call_ncclCommAbort(l.commAbort, j.comm)
			}
		}()
		return nil, fmt.Errorf("cuda: %s did not return within %v (DISTILL_NCCL_TIMEOUT): a rank never joined, or cannot reach this one (check that every rank got the same id, and NCCL_SOCKET_IFNAME)", call, timeout)
	}
}

// collective is the CUDA backend's compute.Collective: one NCCL
// communicator, its operations enqueued on the backend's stream.
type collective struct {
	b          *Backend
	l          *nccl
	rank, size int

	// mu guards comm and failed between the operations (which take it
	// after the backend's mutex) and the watchdog (which takes it alone:
	// the backend's mutex may be held by a call waiting for the very work
	// the watchdog must abort).
	mu     sync.Mutex
	comm   C.ncclComm_t // nil once closed or aborted
	failed error        // why the watchdog aborted the communicator
	closed bool

	stop, stopped chan struct{} // the watchdog's
}

var _ Grouper = (*collective)(nil)

// Grouper is implemented by the CUDA backend's Collective: Group issues
// the operations fn issues as one NCCL group (ncclGroupStart, ncclGroupEnd),
// which NCCL may fuse into one launch (many small gradient buckets). Every
// rank issues the same group.
type Grouper interface {
	Group(fn func())
}

func (c *collective) Rank() int { return c.rank }
func (c *collective) Size() int { return c.size }

// watchdog polls NCCL for an asynchronous error until Close, and aborts
// the communicator on one.
func (c *collective) watchdog() {
	defer close(c.stopped)
	tick := time.NewTicker(ncclWatchdogPeriod)
	defer tick.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-tick.C:
		}
		if c.poll() {
			return
		}
	}
}

// poll asks NCCL for an asynchronous error; on one it aborts the
// communicator, records the error and reports true.
func (c *collective) poll() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.comm == nil {
		return true
	}
	var r C.ncclResult_t
	if st := C.call_ncclCommGetAsyncError(c.l.commGetAsyncError, c.comm, &r); st != C.DK_ncclSuccess {
		r = st
	}
	if r == C.DK_ncclSuccess || r == C.DK_ncclInProgress {
		return false
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	C.call_cuCtxSetCurrent(c.b.drv.cuCtxSetCurrent, c.b.ctx)
	c.failed = fmt.Errorf("%w; the communicator was aborted", c.l.check(fmt.Sprintf("NCCL (rank %d of %d, asynchronously)", c.rank, c.size), r))
	C.call_ncclCommAbort(c.l.commAbort, c.comm)
	c.comm = nil
	c.b.logf("%v", c.failed)
	return true
}

// run issues one NCCL operation with the communicator (the backend's
// mutex held), which writes n bytes on this rank; a failure panics, as a
// failed launch does.
func (c *collective) run(call string, n int64, f func(comm C.ncclComm_t, s C.distill_nccl_stream) C.ncclResult_t) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.closed:
		panic(fmt.Sprintf("cuda: %s on a closed collective", call))
	case c.failed != nil:
		panic(c.failed)
	}
	defer c.b.timedBytes(call, n)()
	c.b.must(c.l.check(fmt.Sprintf("%s (rank %d of %d)", call, c.rank, c.size), f(c.comm, C.distill_nccl_stream(unsafe.Pointer(c.b.stream)))))
}

// f32 unwraps and checks an F32 operand of at least n elements.
func (c *collective) f32(call string, x compute.Tensor, what string, n int) *tensor {
	return c.operand(call, x, what, n, compute.F32)
}

// operand unwraps and checks an operand of at least n elements of one of
// the dtypes dts.
func (c *collective) operand(call string, x compute.Tensor, what string, n int, dts ...compute.DType) *tensor {
	if n < 0 {
		panic(fmt.Sprintf("cuda: %s of %d elements", call, n))
	}
	t := c.b.ten(x, call+" "+what)
	need(t, call+" "+what, n, dts...)
	return t
}

// pair checks a two-buffer operation's operands, dst of dn and src of sn
// elements: F32 (or one of dts when given, the same for both), and not
// overlapping, except in NCCL's in-place layout (the smaller buffer at
// this rank's part of the larger).
func (c *collective) pair(call string, dstT, srcT compute.Tensor, dn, sn int, dts ...compute.DType) (dst, src *tensor) {
	if len(dts) == 0 {
		dts = []compute.DType{compute.F32}
	}
	dst, src = c.operand(call, dstT, "destination", dn, dts...), c.operand(call, srcT, "source", sn, dts...)
	if dst.dt != src.dt {
		panic(fmt.Sprintf("cuda: %s of a %v source into a %v destination: want one dtype", call, src.dt, dst.dt))
	}
	d, s, es := dst.p, src.p, uint64(dst.dt.Size())
	inPlace := d == s+uint64(c.rank*dn)*es // reduce-scatter: dst is src's part
	if dn > sn {
		inPlace = s == d+uint64(c.rank*sn)*es // all-gather: src is dst's part
	}
	if dn > 0 && sn > 0 && d < s+uint64(sn)*es && s < d+uint64(dn)*es && !inPlace {
		panic(fmt.Sprintf("cuda: %s: the destination and the source overlap; only NCCL's in-place layout may (the smaller buffer at rank %d's part of the larger)", call, c.rank))
	}
	return dst, src
}

// issue records the write to the n elements at dst and, unless there are
// none, runs call.
func (c *collective) issue(call string, dst *tensor, n int, f func(comm C.ncclComm_t, s C.distill_nccl_stream) C.ncclResult_t) {
	bytes := int64(n) * int64(dst.dt.Size())
	c.b.wroteRange(dst.p, bytes)
	if n > 0 {
		c.run(call, bytes, f)
	}
}

// AllReduceSum implements compute.Collective: ncclAllReduce in place.
func (c *collective) AllReduceSum(x compute.Tensor, n int) {
	defer c.b.enter()()
	t := c.f32("AllReduceSum", x, "tensor", n)
	c.issue("ncclAllReduce", t, n, func(comm C.ncclComm_t, s C.distill_nccl_stream) C.ncclResult_t {
		return C.call_ncclAllReduce(c.l.allReduce, C.ulonglong(t.p), C.ulonglong(t.p), C.size_t(n), C.DK_ncclFloat32, C.DK_ncclSum, comm, s)
	})
}

// ReduceScatterSum implements compute.Collective: ncclReduceScatter.
func (c *collective) ReduceScatterSum(dstT, srcT compute.Tensor, n int) {
	defer c.b.enter()()
	dst, src := c.pair("ReduceScatterSum", dstT, srcT, n, c.size*n)
	c.issue("ncclReduceScatter", dst, n, func(comm C.ncclComm_t, s C.distill_nccl_stream) C.ncclResult_t {
		return C.call_ncclReduceScatter(c.l.reduceScatter, C.ulonglong(src.p), C.ulonglong(dst.p), C.size_t(n), C.DK_ncclFloat32, C.DK_ncclSum, comm, s)
	})
}

// AllGather implements compute.Collective: ncclAllGather, of F32 or of
// BF16 tensors (ncclBfloat16).
func (c *collective) AllGather(dstT, srcT compute.Tensor, n int) {
	defer c.b.enter()()
	dst, src := c.pair("AllGather", dstT, srcT, c.size*n, n, compute.F32, compute.BF16)
	dt := C.int(C.DK_ncclFloat32)
	if dst.dt == compute.BF16 {
		dt = C.DK_ncclBfloat16
	}
	c.issue("ncclAllGather", dst, c.size*n, func(comm C.ncclComm_t, s C.distill_nccl_stream) C.ncclResult_t {
		return C.call_ncclAllGather(c.l.allGather, C.ulonglong(src.p), C.ulonglong(dst.p), C.size_t(n), dt, comm, s)
	})
}

// Broadcast implements compute.Collective: ncclBroadcast in place.
func (c *collective) Broadcast(x compute.Tensor, n int, root int) {
	defer c.b.enter()()
	if root < 0 || root >= c.size {
		panic(fmt.Sprintf("cuda: Broadcast from root %d in a group of %d", root, c.size))
	}
	t := c.f32("Broadcast", x, "tensor", n)
	c.issue("ncclBroadcast", t, n, func(comm C.ncclComm_t, s C.distill_nccl_stream) C.ncclResult_t {
		return C.call_ncclBroadcast(c.l.broadcast, C.ulonglong(t.p), C.ulonglong(t.p), C.size_t(n), C.DK_ncclFloat32, C.int(root), comm, s)
	})
}

// Group implements Grouper. NCCL keeps a group per thread, so the whole
// group runs on the calling goroutine's OS thread, locked for it: fn must
// issue its operations from this goroutine.
func (c *collective) Group(fn func()) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	c.group(true)
	defer c.group(false)
	fn()
}

// group calls ncclGroupStart (start) or ncclGroupEnd.
func (c *collective) group(start bool) {
	defer c.b.enter()()
	if start {
		c.b.must(c.l.check("ncclGroupStart", C.call_ncclGroupStart(c.l.groupStart)))
	} else {
		c.b.must(c.l.check("ncclGroupEnd", C.call_ncclGroupEnd(c.l.groupEnd)))
	}
}

// Close implements compute.Collective: after the work issued so far,
// ncclCommDestroy. It returns the error that aborted the communicator, if
// one did. Close the collective before its backend.
func (c *collective) Close() error {
	b := c.b
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return fmt.Errorf("cuda: collective (rank %d of %d) closed after its backend", c.rank, c.size)
	}
	b.mu.Unlock()
	defer b.enter()()
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.mu.Unlock()
	// Wait for the issued work with the watchdog still running: an error
	// NCCL finds meanwhile aborts the communicator, and the wait returns.
	syncErr := b.drv.check("cuStreamSynchronize", C.call_cuStreamSynchronize(b.drv.cuStreamSynchronize, b.stream))
	c.mu.Lock()
	c.closed = true
	comm, failed := c.comm, c.failed
	c.comm = nil
	c.mu.Unlock()
	close(c.stop)
	<-c.stopped
	if failed != nil {
		return failed
	}
	err := c.l.check(fmt.Sprintf("ncclCommDestroy (rank %d of %d)", c.rank, c.size), C.call_ncclCommDestroy(c.l.commDestroy, comm))
	if syncErr != nil {
		return syncErr
	}
	return err
}
