package cuda

/*
#include <string.h>
#include "capi.h"
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"
)

// Pinned staging. CUDA copies from pageable host memory (Go's) through a
// pinned buffer of its own, and may make the host wait for the stream to
// do so (cuMemcpyHtoDAsync's documented behaviour): an upload of a
// training row's data (token ids, RoPE tables, the loss head's targets),
// issued while the GPU still runs the previous row, could then hold the
// host until the GPU reached it, and the GPU would idle while the host
// issued what follows. upload instead copies the data into a ring of
// pinned buffers, from which the copy never waits; and a loss's values
// come back into a pinned block without a wait, read when the host needs
// them (lossValues).
//
// The ring is four pinned buffers ("quarters"), filled in turn. Leaving
// a quarter records an event on the stream after the last copy from it;
// the host writes a quarter again only when that event is known done: it
// has synchronized with the stream since (epoch: the count of the host's
// stream synchronizations), or it waits for the event (cuEventSynchronize,
// counted as a WaitEvent: it does not drain the stream). When the next
// quarter is not known done, the ring doubles instead, up to
// stageQuarterMax a quarter, so that a step's uploads fit between two of
// its synchronizations and the host never waits for them (a Qwen3-0.6B
// row of 8192 tokens uploads about 10 MiB: its RoPE tables, the
// teacher's ids and log-probs, their columns; beyond 48 MiB a step the
// host waits for the copies of uploads three quarters back: an event in
// the middle of the stream, which leaves the GPU the work queued after
// it). The emulator
// checks that the host never writes a quarter a copy may still read, nor
// reads a block a copy may still write (distill_emu_host_access).

const (
	stageQuarters   = 4
	stageQuarterMin = 1 << 20  // a quarter's first size
	stageQuarterMax = 16 << 20 // the ring's largest: 64 MiB of pinned memory
	stageMax        = 16 << 20 // larger uploads (weights) stay pageable
	stageAlign      = 256
)

// staging is the backend's pinned memory for copies (staging.go).
type staging struct {
	q     [stageQuarters]stageQuarter
	cur   int   // the quarter being filled
	qs    int64 // a quarter's bytes; 0 before the first upload
	epoch uint64
	// blocks are pinned buffers for downloads, free ones by size (a power
	// of two); all of them, for release.
	free map[int64][]unsafe.Pointer
	all  []unsafe.Pointer
	// hostCheck is the emulator's distill_emu_host_access; nil on a GPU.
	hostCheck unsafe.Pointer
	// quarterMax bounds a quarter's bytes (stageQuarterMax; tests lower it
	// to make the ring wrap within a step).
	quarterMax int64
}

type stageQuarter struct {
	p     unsafe.Pointer // qs bytes of cuMemAllocHost; nil until used
	used  int64
	ev    C.CUevent // recorded when the ring last left this quarter
	evSet bool      // ev is recorded after copies that may still run
	evAt  uint64    // the epoch when ev was recorded
	useAt uint64    // the epoch of the last copy from it
}

// synced notes that the host has waited for everything issued on the
// main stream: every event recorded before is done.
func (st *staging) synced() { st.epoch++ }

// stageUpload copies n bytes at src into the ring and returns the pinned
// copy, or nil when n is too large to stage (or the call runs on the side
// stream: Beside, whose events the ring does not follow).
func (b *Backend) stageUpload(src unsafe.Pointer, n int64) unsafe.Pointer {
	st := &b.stage
	if n > stageMax || b.besideOn {
		return nil
	}
	if st.quarterMax == 0 {
		st.quarterMax = stageQuarterMax
	}
	need := (n + stageAlign - 1) / stageAlign * stageAlign
	if need > st.qs {
		b.growStage(need)
	}
	q := &st.q[st.cur]
	if q.p != nil && q.used+need > st.qs {
		q = b.nextQuarter(need)
	}
	if q.p == nil {
		b.must(b.drv.check(fmt.Sprintf("cuMemAllocHost(%d bytes)", st.qs), C.call_cuMemAllocHost(b.drv.cuMemAllocHost, &q.p, C.size_t(st.qs))))
		q.used = 0
	}
	if q.used == 0 {
		// Entering the quarter: every copy from it (the last lap's) must
		// be done. Within a lap the ring appends where no copy reads (the
		// emulator sees whole allocations, so it is asked here only).
		b.hostAccess(q.p, true, "the upload staging ring")
	}
	p := unsafe.Add(q.p, q.used)
	q.used, q.useAt = q.used+need, st.epoch
	C.memcpy(p, src, C.size_t(n))
	return p
}

// nextQuarter leaves the quarter being filled (an event after its
// copies) and returns the next one, empty: waited for if the host has
// not synchronized since it left it, or the ring grown instead while it
// may (a grown ring starts anew).
func (b *Backend) nextQuarter(need int64) *stageQuarter {
	st := &b.stage
	q := &st.q[st.cur]
	q.evSet = q.useAt == st.epoch // else the host has waited for its copies
	if q.evSet {
		if q.ev == nil {
			b.must(b.drv.check("cuEventCreate", C.call_cuEventCreate(b.drv.cuEventCreate, &q.ev, eventDisableTiming)))
		}
		b.must(b.drv.check("cuEventRecord", C.call_cuEventRecord(b.drv.cuEventRecord, q.ev, b.stream)))
		q.evAt = st.epoch
	}
	st.cur = (st.cur + 1) % stageQuarters
	n := &st.q[st.cur]
	if n.evSet && n.evAt == st.epoch { // its copies may still run
		if 2*st.qs <= st.quarterMax {
			b.growStage(2 * st.qs)
			return &st.q[st.cur]
		}
		b.waited(WaitEvent)
		t0 := time.Now()
		b.must(b.drv.check("cuEventSynchronize", C.call_cuEventSynchronize(b.drv.cuEventSynchronize, n.ev)))
		b.noteWait(t0)
	}
	n.used = 0
	return n
}

// growStage replaces the ring by one of quarters of at least need bytes
// (doubling), after the copies from the old one are done: a
// synchronization, counted (a warm-up's, as the ring finds its size).
func (b *Backend) growStage(need int64) {
	st := &b.stage
	qs := max(st.qs, stageQuarterMin)
	for qs < need {
		qs *= 2
	}
	if st.qs > 0 {
		qs = max(qs, 2*st.qs)
	}
	b.releaseRing()
	st.qs, st.cur = qs, 0
}

// releaseRing frees the ring's buffers once their copies are done.
func (b *Backend) releaseRing() {
	st := &b.stage
	used := false
	for i := range st.q {
		used = used || st.q[i].p != nil
	}
	if used {
		b.sync()
	}
	for i := range st.q {
		q := &st.q[i]
		if q.p != nil {
			C.call_cuMemFreeHost(b.drv.cuMemFreeHost, q.p)
		}
		q.p, q.used, q.evSet = nil, 0, false
	}
}

// pinnedBlock returns a pinned block of at least n bytes for a download
// (putBlock gives it back), and its size.
func (b *Backend) pinnedBlock(n int64) (unsafe.Pointer, int64) {
	st := &b.stage
	size := int64(stageAlign)
	for size < n {
		size *= 2
	}
	if fs := st.free[size]; len(fs) > 0 {
		p := fs[len(fs)-1]
		st.free[size] = fs[:len(fs)-1]
		return p, size
	}
	var p unsafe.Pointer
	b.must(b.drv.check(fmt.Sprintf("cuMemAllocHost(%d bytes)", size), C.call_cuMemAllocHost(b.drv.cuMemAllocHost, &p, C.size_t(size))))
	st.all = append(st.all, p)
	return p, size
}

// laterCopy is a download into a pinned block that the host reads later
// (arrived): ev is recorded after the copy, in the staging's epoch at.
type laterCopy struct {
	host unsafe.Pointer
	size int64 // the block's bytes (putBlock)
	ev   C.CUevent
	at   uint64
}

// downloadLater copies n bytes at device address p into a pinned block
// after the work issued so far, without waiting.
func (b *Backend) downloadLater(p uint64, n int64) *laterCopy {
	c := &laterCopy{}
	c.host, c.size = b.pinnedBlock(n)
	b.must(b.drv.check("cuMemcpyDtoHAsync", C.call_cuMemcpyDtoHAsync(b.drv.cuMemcpyDtoHAsync, c.host, C.CUdeviceptr(p), C.size_t(n), b.stream)))
	c.ev, c.at = b.plainEvent(b.stream), b.stage.epoch
	return c
}

// arrived waits for c's copy unless the host has synchronized with the
// stream since it was issued (a WaitEvent: it waits for the copy, not for
// the work issued after it) and returns its block, the caller's to read
// and then to give back (putBlock).
func (b *Backend) arrived(c *laterCopy, what string) unsafe.Pointer {
	if c.at == b.stage.epoch {
		b.waited(WaitEvent)
		t0 := time.Now()
		b.must(b.drv.check("cuEventSynchronize", C.call_cuEventSynchronize(b.drv.cuEventSynchronize, c.ev)))
		b.noteWait(t0)
	}
	b.evPlain = append(b.evPlain, c.ev)
	c.ev = nil
	b.hostAccess(c.host, false, what)
	return c.host
}

// putBlock returns a block that no copy uses any more.
func (b *Backend) putBlock(p unsafe.Pointer, size int64) {
	st := &b.stage
	if st.free == nil {
		st.free = map[int64][]unsafe.Pointer{}
	}
	st.free[size] = append(st.free[size], p)
}

// releaseStage frees the staging memory; the stream is synchronized.
func (b *Backend) releaseStage() {
	st := &b.stage
	for i := range st.q {
		q := &st.q[i]
		if q.p != nil {
			C.call_cuMemFreeHost(b.drv.cuMemFreeHost, q.p)
		}
		if q.ev != nil {
			C.call_cuEventDestroy(b.drv.cuEventDestroy, q.ev)
		}
		*q = stageQuarter{}
	}
	for _, p := range st.all {
		C.call_cuMemFreeHost(b.drv.cuMemFreeHost, p)
	}
	st.all, st.free, st.qs = nil, nil, 0
}

// hostAccess asks the emulator whether the host may read (write false)
// or write the pinned memory at p now; a GPU is not asked.
func (b *Backend) hostAccess(p unsafe.Pointer, write bool, what string) {
	if b.stage.hostCheck == nil {
		return
	}
	w := C.int(0)
	if write {
		w = 1
	}
	if msg := C.call_distill_emu_host_access(b.stage.hostCheck, p, w); msg != nil {
		panic(fmt.Sprintf("cuda: %s: %s", what, C.GoString(msg)))
	}
}
