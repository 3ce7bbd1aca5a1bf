package cuda

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"distill/compute"
)

// waitsOf sums the counted host waits of each kind.
func waitsOf(ws []HostWait) map[string]int {
	m := map[string]int{}
	for _, w := range ws {
		m[w.Kind] += w.Count
	}
	return m
}

// TestStagingRing: uploads through the pinned staging ring (staging.go)
// arrive intact while the ring wraps around laps with no synchronization
// between them (the host reuses each quarter only after waiting for the
// event recorded after its copies: counted WaitEvents, and on the
// emulator held to its stream-order checks of pinned memory), need no
// wait in a lap after a synchronization, grow the ring for an upload
// larger than a quarter, and leave uploads above stageMax pageable. The
// sources are overwritten as each upload returns, as callers may.
func TestStagingRing(t *testing.T) {
	b := testBackend(t)
	b.stage.quarterMax = stageQuarterMin // the ring cannot grow: it must wait
	b.CountHostWaits(true)
	const n = 96 << 10 // 384 KiB an upload: 2 a quarter, 8 a lap
	var ts []compute.Tensor
	var want [][]int32
	upload := func(k, n int) {
		src := make([]int32, n)
		w := make([]int32, n)
		for i := range src {
			src[i] = int32(k*1_000_003 + i*7)
			w[i] = src[i]
		}
		ts = append(ts, b.FromI32(src))
		want = append(want, w)
		for i := range src {
			src[i] = -1 // the caller's to reuse
		}
	}
	check := func(phase string) {
		t.Helper()
		for k, x := range ts {
			got := make([]int32, len(want[k]))
			b.ReadI32(x, got)
			for i := range got {
				if got[i] != want[k][i] {
					t.Fatalf("%s: upload %d, element %d: %d, want %d", phase, k, i, got[i], want[k][i])
				}
			}
			b.Free(x)
		}
		ts, want = nil, nil
	}
	for k := 0; k < 24; k++ { // three laps
		upload(k, n)
	}
	w := waitsOf(b.HostWaits())
	// Laps 2 and 3 enter each quarter once: 8 waits, and nothing else.
	if w[WaitEvent] != 8 || len(w) != 1 {
		t.Errorf("three laps of the ring without a synchronization: waits %v, want 8 %s", w, WaitEvent)
	}
	check("three laps")
	b.HostWaits()
	for k := 0; k < 8; k++ { // a lap after the host synchronized (check read)
		upload(k, n)
	}
	if w := b.HostWaits(); len(w) != 0 {
		t.Errorf("a lap after a synchronization: waits %v, want none", w)
	}
	check("a lap after a synchronization")
	b.HostWaits()
	upload(0, 3<<20/4) // 3 MiB: the ring grows (a synchronization first)
	if w := waitsOf(b.HostWaits()); w[WaitSync] != 1 || len(w) != 1 {
		t.Errorf("an upload larger than a quarter: waits %v, want the growth's 1 %s", w, WaitSync)
	}
	if b.stage.qs < 3<<20 {
		t.Errorf("after a 3 MiB upload the ring's quarters are %d bytes", b.stage.qs)
	}
	upload(1, (stageMax+4)/4) // above stageMax: from Go's memory
	if w := waitsOf(b.HostWaits()); w[WaitUpload] != 1 || len(w) != 1 {
		t.Errorf("an upload above stageMax: waits %v, want 1 %s", w, WaitUpload)
	}
	check("grown")
}

// TestStagingHostChecks: the emulator's check of the host's own accesses
// to pinned memory (distill_emu_host_access), which the ring and the
// loss values' blocks rely on, fails a host write of a buffer a copy
// issued since the host last waited reads, and a host read of a block a
// copy may still write; after the waits, it passes.
func TestStagingHostChecks(t *testing.T) {
	if onGPU() {
		t.Skip("the emulator's checks")
	}
	b := testBackend(t)
	if b.stage.hostCheck == nil {
		t.Fatal("the emulator has no distill_emu_host_access")
	}
	try := func(f func()) (msg string) {
		defer func() {
			if r := recover(); r != nil {
				msg = fmt.Sprint(r)
			}
		}()
		f()
		return ""
	}
	func() {
		defer b.enter()()
		dev := b.alloc(1 << 10)
		defer b.free(dev)
		src := make([]byte, 1<<10)
		p := b.stageUpload(unsafePtr(src), int64(len(src)))
		b.uploadPinned(dev, p, int64(len(src)))
		q := b.stage.q[b.stage.cur].p
		if msg := try(func() { b.hostAccess(q, true, "test") }); !strings.Contains(msg, "stream-order race: the host writes") {
			t.Errorf("host write of a quarter an unwaited copy reads: %q, want a race", msg)
		}
		c := b.downloadLater(dev, 1<<10)
		if msg := try(func() { b.hostAccess(c.host, false, "test") }); !strings.Contains(msg, "stream-order race: the host reads") {
			t.Errorf("host read of a block an unwaited copy writes: %q, want a race", msg)
		}
		b.waits = hostWaits{}
		if msg := try(func() { b.arrived(c, "test") }); msg != "" {
			t.Errorf("arrived: %s", msg)
		}
		n := 0
		for k, c := range b.waits {
			if k[0] == WaitEvent {
				n += c
			}
		}
		if n != 1 || len(b.waits) != 1 {
			t.Errorf("arrived without a synchronization since the copy: waits %v, want one %s", b.waits, WaitEvent)
		}
		b.putBlock(c.host, c.size)
		b.sync()
		if msg := try(func() { b.hostAccess(q, true, "test") }); msg != "" {
			t.Errorf("host write after a synchronization: %s", msg)
		}
		b.waits = nil
	}()
}

// TestHostTimeline: while profiling, the backend notes its first and last
// call, its first timed launch and its host waits, in the order they
// happen on the host; off, and after SetProfile, nothing.
func TestHostTimeline(t *testing.T) {
	b := testBackend(t)
	x := b.FromF32(make([]float32, 1024))
	defer b.Free(x)
	b.SetProfile(true)
	if tl := b.HostTimeline(); tl != (HostTimeline{}) {
		t.Fatalf("a fresh profile's timeline: %+v", tl)
	}
	p0 := time.Now()
	y := b.New(compute.F32, 1024) // a call (and its memset, a launch)
	afterNew := b.HostTimeline()
	b.Scale(x, 1024, 2) // a launch
	out := make([]float32, 1024)
	b.ReadF32(x, out) // a host wait
	b.Free(y)
	p1 := time.Now()
	tl := b.HostTimeline()
	if afterNew.First.IsZero() || afterNew.Waits != 0 {
		t.Fatalf("after New alone: %+v, want a first call and no wait", afterNew)
	}
	if tl.First != afterNew.First || tl.FirstLaunch.Before(tl.First) || tl.Last.Before(tl.FirstLaunch) || tl.First.Before(p0) || p1.Before(tl.Last) {
		t.Fatalf("timeline %+v out of order (pass %v to %v)", tl, p0, p1)
	}
	if tl.Waits != 1 || tl.LastWaitEnd.Before(tl.FirstLaunch) || tl.Last.Before(tl.LastWaitEnd) || tl.Waited <= 0 {
		t.Fatalf("timeline %+v: want the read's one wait, between the launch and the last call", tl)
	}
	if line := tl.Describe("pass", p0, p1); !strings.Contains(line, "1 host waits") || strings.Contains(line, "NaN") {
		t.Fatalf("Describe: %s", line)
	}
	b.SetProfile(false)
	b.Scale(x, 1024, 2)
	if tl := b.HostTimeline(); tl != (HostTimeline{}) {
		t.Fatalf("profiling off: %+v", tl)
	}
}
