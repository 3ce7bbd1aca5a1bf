package cuda

import (
	"slices"
	"strings"
	"testing"

	"distill/compute"
)

// TestBesideStreamOrder: work run Beside the main stream sees what was
// issued before it, and the main stream sees it after the Fence's Wait;
// without the Wait, the emulator's stream-order checks (emu.cpp) report a
// race naming both operations, for a read after the side's write, a
// write after the side's read, and a free of memory the side used.
func TestBesideStreamOrder(t *testing.T) {
	if onGPU() {
		t.Skip("the emulator's checks (on a GPU the fenced half of this test is TestBesideOverlap's)")
	}
	useEmu(t)
	b := openOn(t, 0, nil)
	n := 64
	x, y, z := b.New(compute.F32, n), b.New(compute.F32, n), b.New(compute.F32, n)
	ones := make([]float32, n)
	for i := range ones {
		ones[i] = float32(i)
	}
	b.WriteF32(x, ones)
	b.WriteF32(y, ones)
	try := func(f func()) (msg string) {
		defer func() {
			if r := recover(); r != nil {
				msg = fmtf("%v", r)
			}
		}()
		f()
		return ""
	}
	race := func(what, msg string) {
		t.Helper()
		if !strings.Contains(msg, "stream-order race") || !strings.Contains(msg, "k_add (parameter") {
			t.Errorf("%s: %q, want a stream-order race naming both operations", what, msg)
		}
	}

	// Fenced: the side adds y into x (after the main stream's writes), the
	// main stream reads x after Wait.
	f := b.Beside(func() { b.Add(x, y, n) })
	f.Wait()
	b.Copy(z, x)
	got := make([]float32, n)
	b.ReadF32(z, got)
	for i := range got {
		if got[i] != 2*float32(i) {
			t.Fatalf("z[%d] = %v, want %v", i, got[i], 2*float32(i))
		}
	}

	// The main stream reads what the side wrote, with no Wait.
	f = b.Beside(func() { b.Add(x, y, n) })
	race("read after the side's write", try(func() { b.Copy(z, x) }))
	f.Wait()

	// The main stream writes what the side reads, with no Wait (Scale: a
	// Zero's memset would wait for the next call, zeros.go).
	f = b.Beside(func() { b.Add(z, y, n) })
	race("write after the side's read", try(func() { b.Scale(y, n, 2) }))
	f.Wait()
	b.Zero(y)

	// Freed on the main stream while the side may still use it.
	w := b.New(compute.F32, n)
	f = b.Beside(func() { b.Add(w, x, n) })
	race("free of memory the side used", try(func() { b.Free(w) }))
	f.Wait()
	b.Free(w)

	// The host waited for the main stream, which waited for the side.
	f = b.Beside(func() { b.Add(x, x, n) })
	f.Wait()
	if b.ReadF32(x, got); !slices.Equal(got[:2], []float32{0, 6}) {
		t.Errorf("x after the last fenced add: %v, want 0, 6, ...", got[:2])
	}
}
