package cuda

/*
#include "capi.h"
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"

	"distill/compute"
)

// Copies between backends (compute.CrossCopier): a pipelined teacher
// keeps each stage on a backend of its own (a GPU, or a stream of a GPU
// that several stages share) and hands a micro-batch's activations from
// one to the next. How a pair of backends copies is decided once per
// pair, on the first copy, and logged:
//
//   - the same GPU (two streams): a device-to-device copy on the
//     destination's stream;
//   - two GPUs the driver lets the destination reach the source
//     (cuDeviceCanAccessPeer): peer access enabled for the source's pool
//     (cuMemPoolSetAccess: the tensors are stream-ordered pool
//     allocations) and its context (cuCtxEnablePeerAccess), then
//     cuMemcpyPeerAsync on the destination's stream;
//   - otherwise through a pinned host buffer of the destination's, in
//     chunks of at most stageChunk bytes: down on the source's stream,
//     up on the destination's.
//
// No host waits for either stream: the order is kept on the devices with
// events. The destination's stream waits (cuStreamWaitEvent) for the
// source's mark (compute.Marker: an event the source recorded when it
// issued what produced src; without one, an event recorded now), copies,
// and records an event the source's stream then waits for, so that the
// source's later work (a Free of src, the pool's reuse of its memory, a
// write) runs after the copy has read it. Through the host, each chunk's
// upload waits for its download, and the next download into the buffer
// for the upload before it; a download runs on the source's stream, so
// it also waits for what the source issued after the mark (the peer
// paths do not). The backends' locks are never held together.

// Copy paths between two backends.
const (
	pathSameGPU = "same GPU"
	pathPeer    = "peer to peer (cuMemcpyPeerAsync)"
	pathHost    = "through pinned host memory"
)

// stageChunk bounds a pinned staging buffer.
var stageChunk int64 = 64 << 20

// peerState is a backend's record of the backends it has copied from,
// its pinned staging buffer, and its ordering events.
type peerState struct {
	mu      sync.Mutex // held over a whole staged copy: the buffer is one
	paths   map[*Backend]string
	host    unsafe.Pointer // pinned, stageCap bytes
	cap     int64
	bufFree C.CUevent // recorded after the last upload from host (nil: none yet)

	evMu sync.Mutex
	evs  []C.CUevent // ordering events for reuse
}

// record records an ordering event (a recycled one, else a new one) on
// the stream; b's call is in progress (enter).
func (b *Backend) record() C.CUevent {
	var e C.CUevent
	b.peer.evMu.Lock()
	if n := len(b.peer.evs); n > 0 {
		e, b.peer.evs = b.peer.evs[n-1], b.peer.evs[:n-1]
	}
	b.peer.evMu.Unlock()
	if e == nil {
		b.must(b.drv.check("cuEventCreate", C.call_cuEventCreate(b.drv.cuEventCreate, &e, eventDisableTiming)))
	}
	b.must(b.drv.check("cuEventRecord", C.call_cuEventRecord(b.drv.cuEventRecord, e, b.stream)))
	return e
}

// recycle keeps b's event e for reuse: the waits already enqueued on it
// keep the record they saw (a later record does not move them).
func (b *Backend) recycle(e C.CUevent) {
	b.peer.evMu.Lock()
	b.peer.evs = append(b.peer.evs, e)
	b.peer.evMu.Unlock()
}

// waitOn makes the stream's later work wait for event e (of any GPU);
// b's call is in progress (enter).
func (b *Backend) waitOn(e C.CUevent) {
	b.must(b.drv.check("cuStreamWaitEvent", C.call_cuStreamWaitEvent(b.drv.cuStreamWaitEvent, b.stream, e, 0)))
}

// mark is the CUDA backend's compute.Mark: an event on its stream.
type mark struct {
	b        *Backend
	ev       C.CUevent
	released bool
}

// Mark implements compute.Marker: an event recorded on the stream after
// the work issued so far.
func (b *Backend) Mark() compute.Mark {
	defer b.enter()()
	return &mark{b: b, ev: b.record()}
}

// Release implements compute.Mark.
func (m *mark) Release() {
	if !m.released {
		m.released = true
		m.b.recycle(m.ev)
	}
}

// DeviceName implements compute.DeviceNamer: "GPU 1 (NVIDIA H100 80GB HBM3)".
func (b *Backend) DeviceName() string { return fmt.Sprintf("GPU %d (%s)", b.info.Ordinal, b.info.Name) }

// CopyFrom implements compute.CrossCopier for a tensor of another CUDA
// backend (see above); false for any other backend.
func (b *Backend) CopyFrom(dstT compute.Tensor, from compute.Backend, srcT compute.Tensor, after compute.Mark) bool {
	f, ok := from.(*Backend)
	if !ok {
		return false
	}
	if f == b { // one stream: in order
		b.Copy(dstT, srcT)
		return true
	}
	dst, src := b.ten(dstT, "CopyFrom destination"), f.ten(srcT, "CopyFrom source")
	if dst.dt != src.dt || dst.n < src.n {
		panic(fmt.Sprintf("cuda: CopyFrom of %d %v elements into %d %v", src.n, src.dt, dst.n, dst.dt))
	}
	n := src.bytes()
	if n == 0 {
		return true
	}
	path := b.PeerPath(f)
	if path == pathHost {
		b.copyThroughHost(f, dst.p, src.p, n)
		return true
	}
	// ready: the point of f's work the copy waits for.
	ready, own := C.CUevent(nil), false
	if mk, ok := after.(*mark); ok && mk.b == f && !mk.released {
		ready = mk.ev
	} else {
		func() {
			defer f.enter()()
			ready, own = f.record(), true
		}()
	}
	if own {
		defer f.recycle(ready)
	}
	done := func() C.CUevent {
		defer b.enter()()
		b.wrote(dst)
		b.waitOn(ready)
		if path == pathSameGPU {
			b.copyD(dst.p, src.p, n)
		} else {
			b.must(b.drv.check("cuMemcpyPeerAsync", C.call_cuMemcpyPeerAsync(b.drv.cuMemcpyPeerAsync, C.CUdeviceptr(dst.p), b.ctx,
				C.CUdeviceptr(src.p), f.ctx, C.size_t(n), b.stream)))
		}
		return b.record()
	}()
	func() { // f's later work (freeing src) after the copy
		defer f.enter()()
		f.waitOn(done)
	}()
	b.recycle(done)
	return true
}

// copyThroughHost copies n bytes from src on f to dst on b through b's
// pinned staging buffer: each chunk down on f's stream (after the upload
// that last used the buffer; f's stream is past the mark already), then
// up on b's once it is down.
func (b *Backend) copyThroughHost(f *Backend, dst, src uint64, n int64) {
	b.peer.mu.Lock()
	defer b.peer.mu.Unlock()
	chunk := min(n, stageChunk)
	if b.peer.cap < chunk {
		func() {
			defer b.enter()()
			if b.peer.host != nil {
				b.sync() // the last upload from the buffer, and the downloads before it
				C.call_cuMemFreeHost(b.drv.cuMemFreeHost, b.peer.host)
				b.peer.host, b.peer.cap = nil, 0
			}
			b.must(b.drv.check(fmt.Sprintf("cuMemAllocHost(%d bytes)", chunk), C.call_cuMemAllocHost(b.drv.cuMemAllocHost, &b.peer.host, C.size_t(chunk))))
			b.peer.cap = chunk
		}()
	}
	for off := int64(0); off < n; off += chunk {
		m := min(chunk, n-off)
		down := func() C.CUevent {
			defer f.enter()()
			if b.peer.bufFree != nil {
				f.waitOn(b.peer.bufFree)
			}
			f.must(f.drv.check("cuMemcpyDtoHAsync", C.call_cuMemcpyDtoHAsync(f.drv.cuMemcpyDtoHAsync, b.peer.host, C.CUdeviceptr(src+uint64(off)), C.size_t(m), f.stream)))
			return f.record()
		}()
		func() {
			defer b.enter()()
			b.waitOn(down)
			b.wroteRange(dst+uint64(off), m)
			b.uploadPinned(dst+uint64(off), b.peer.host, m)
			if b.peer.bufFree != nil {
				b.recycle(b.peer.bufFree)
			}
			b.peer.bufFree = b.record()
		}()
		f.recycle(down)
	}
}

// PeerPath says how this backend copies from f (CopyFrom), deciding it on
// the first call for the pair: the same GPU, peer to peer, or through
// pinned host memory.
func (b *Backend) PeerPath(f *Backend) string {
	b.peer.mu.Lock()
	p, ok := b.peer.paths[f]
	b.peer.mu.Unlock()
	if ok {
		return p
	}
	p = pathHost
	switch {
	case f.info.Ordinal == b.info.Ordinal:
		p = pathSameGPU
	case b.enablePeer(f):
		p = pathPeer
	}
	b.logf("cuda: copies from GPU %d to GPU %d: %s", f.info.Ordinal, b.info.Ordinal, p)
	b.peer.mu.Lock()
	if b.peer.paths == nil {
		b.peer.paths = map[*Backend]string{}
	}
	b.peer.paths[f] = p
	b.peer.mu.Unlock()
	return p
}

// enablePeer lets b reach f's memory where the driver allows it: f's
// pool grants b's device access, and b's context enables access to f's.
// false when the driver says b's device cannot reach f's, or a step
// fails (logged: the copies then go through the host).
func (b *Backend) enablePeer(f *Backend) bool {
	var can C.int
	err := func() error {
		defer b.enter()()
		if err := b.drv.check("cuDeviceCanAccessPeer", C.call_cuDeviceCanAccessPeer(b.drv.cuDeviceCanAccessPeer, &can, b.dev, f.dev)); err != nil || can == 0 {
			return err
		}
		r := C.call_cuCtxEnablePeerAccess(b.drv.cuCtxEnablePeerAccess, f.ctx, 0)
		if r == errPeerAlreadyEnabled {
			r = 0
		}
		return b.drv.check("cuCtxEnablePeerAccess", r)
	}()
	if err == nil && can != 0 {
		err = f.setPoolAccess(b.info.Ordinal, memAccessReadWrite)
	}
	if err != nil {
		b.logf("cuda: GPU %d cannot reach GPU %d's memory (%v): copies go through the host", b.info.Ordinal, f.info.Ordinal, err)
		return false
	}
	return can != 0
}

// setPoolAccess sets what GPU ord may do with the memory of this
// backend's pool (flags: 0 nothing, memAccessReadWrite).
func (b *Backend) setPoolAccess(ord, flags int) error {
	defer b.enter()()
	acc := C.distill_mem_access{_type: memLocationDevice, id: C.int(ord), flags: C.int(flags)}
	return b.drv.check("cuMemPoolSetAccess", C.call_cuMemPoolSetAccess(b.drv.cuMemPoolSetAccess, b.pool, &acc, 1))
}

// releasePeer frees the pinned staging buffer and the ordering events
// (Close).
func (b *Backend) releasePeer() {
	if b.peer.bufFree != nil {
		b.peer.evs = append(b.peer.evs, b.peer.bufFree)
		b.peer.bufFree = nil
	}
	for _, e := range b.peer.evs {
		C.call_cuEventDestroy(b.drv.cuEventDestroy, e)
	}
	b.peer.evs = nil
	if b.peer.host != nil {
		C.call_cuMemFreeHost(b.drv.cuMemFreeHost, b.peer.host)
		b.peer.host, b.peer.cap = nil, 0
	}
	b.peer.paths = nil
}
