package cuda

/*
#include "capi.h"
*/
import "C"

import "distill/compute"

// The second stream (compute.Overlapper): ZeRO's collectives run there,
// beside the kernels, ordered against them by events only (the host never
// waits). Beside records an event on the main stream and makes the side
// stream wait for it, so the side work sees everything issued before; it
// then points b.stream at the side stream while f issues its work (every
// method, and the backend's NCCL collective, issues on b.stream), records
// an event there, and points b.stream back. The Fence's Wait makes the
// main stream wait for that event.
//
// The cuBLASLt workspace and cuDNN's handle are the main stream's: f may
// run the elementwise kernels, copies and collectives, not GEMMs or
// attention (the emulator's stream-order checks report a GEMM beside a
// GEMM through their shared workspace no better than the GPU would: not
// at all; so it is a rule). The emulator runs both streams' work when it
// is issued and checks the order (compute/cuda/testdata/emu/emu.cpp,
// "stream order"): work beside that touches what the main stream uses
// with no event between them fails there.

// fence is side-stream work's end (compute.Fence).
type fence struct {
	b  *Backend
	ev C.CUevent
}

// Beside implements compute.Overlapper.
func (b *Backend) Beside(f func()) compute.Fence {
	func() {
		defer b.enter()()
		if b.besideOn {
			panic("cuda: Beside inside Beside")
		}
		if b.side == nil {
			b.must(b.drv.check("cuStreamCreate", C.call_cuStreamCreate(b.drv.cuStreamCreate, &b.side, streamNonBlocking)))
		}
		b.streamWait(b.side, b.stream)
		b.main, b.stream, b.besideOn = b.stream, b.side, true
	}()
	done := false
	defer func() {
		if !done { // f panicked: point the backend back at its stream
			defer b.enter()()
			b.stream, b.besideOn = b.main, false
		}
	}()
	f()
	done = true
	defer b.enter()()
	ev := b.plainEvent(b.side)
	b.stream, b.besideOn = b.main, false
	return &fence{b: b, ev: ev}
}

// Wait implements compute.Fence.
func (f *fence) Wait() {
	b := f.b
	defer b.enter()()
	if f.ev == nil {
		return
	}
	b.must(b.drv.check("cuStreamWaitEvent", C.call_cuStreamWaitEvent(b.drv.cuStreamWaitEvent, b.stream, f.ev, 0)))
	b.counted(profStreamWait)
	b.evPlain = append(b.evPlain, f.ev) // a wait already made may outlive a re-record
	f.ev = nil
}

// streamWait makes stream to wait for the work issued on from so far.
func (b *Backend) streamWait(to, from C.CUstream) {
	ev := b.plainEvent(from)
	b.must(b.drv.check("cuStreamWaitEvent", C.call_cuStreamWaitEvent(b.drv.cuStreamWaitEvent, to, ev, 0)))
	b.counted(profStreamWait)
	b.evPlain = append(b.evPlain, ev)
}

// plainEvent records an event without timing (a recycled one, else new)
// on stream s.
func (b *Backend) plainEvent(s C.CUstream) C.CUevent {
	var e C.CUevent
	if n := len(b.evPlain); n > 0 {
		e, b.evPlain = b.evPlain[n-1], b.evPlain[:n-1]
	} else {
		b.must(b.drv.check("cuEventCreate", C.call_cuEventCreate(b.drv.cuEventCreate, &e, eventDisableTiming)))
	}
	b.must(b.drv.check("cuEventRecord", C.call_cuEventRecord(b.drv.cuEventRecord, e, s)))
	return e
}

// eventDisableTiming is CU_EVENT_DISABLE_TIMING: an event for ordering
// only, cheaper to record and wait for.
const eventDisableTiming = 0x2
