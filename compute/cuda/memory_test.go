package cuda

import (
	"strings"
	"testing"

	"distill/compute"
)

// TestMemoryOps covers the memory methods: zeroed New, View sharing its
// parent's memory, Zero, Copy, WriteF32, BF16 read back widened, Free.
func TestMemoryOps(t *testing.T) {
	be := testBackend(t)
	a := be.New(compute.F32, 6)
	if got := readF32(be, a, 6); got[0] != 0 || got[5] != 0 {
		t.Fatalf("New is not zeroed: %v", got)
	}
	be.WriteF32(a, []float32{1, 2, 3, 4, 5, 6})
	v := be.View(a, 2, 3)
	if got := readF32(be, v, 3); got[0] != 3 || got[2] != 5 {
		t.Fatalf("View [2,5): %v", got)
	}
	be.Zero(v)
	if got := readF32(be, a, 6); got[1] != 2 || got[2] != 0 || got[4] != 0 || got[5] != 6 {
		t.Fatalf("Zero of a view: %v", got)
	}
	c := be.New(compute.F32, 8)
	be.Copy(c, a)
	if got := readF32(be, c, 8); got[5] != 6 || got[6] != 0 {
		t.Fatalf("Copy: %v", got)
	}
	w, err := be.Weight([]uint16{compute.F32ToBF16(1.5), compute.F32ToBF16(-2)})
	if err != nil {
		t.Fatal(err)
	}
	if got := readF32(be, w, 2); got[0] != 1.5 || got[1] != -2 {
		t.Fatalf("BF16 read back: %v", got)
	}
	if _, err := be.Weight([]int{1}); err == nil || !strings.Contains(err.Error(), "[]int") {
		t.Fatalf("Weight([]int): %v", err)
	}
	ids := be.FromI32([]int32{7, -1})
	got := make([]int32, 2)
	be.ReadI32(ids, got)
	if got[0] != 7 || got[1] != -1 {
		t.Fatalf("ReadI32: %v", got)
	}
	be.Free(v) // a view: no-op
	be.Free(a)
	be.Free(a) // twice: no-op
	mustPanic(t, "freed", func() { be.ReadF32(a, make([]float32, 1)) })
	mustPanic(t, "another backend", func() { be.Add(oracle.New(compute.F32, 1), c, 1) })
	mustPanic(t, "has 8 elements, the call needs 9", func() { be.Add(c, c, 9) })
	mustPanic(t, "is i32", func() { be.Add(ids, ids, 1) })
}

func mustPanic(t *testing.T, want string, fn func()) {
	t.Helper()
	defer func() {
		t.Helper()
		r := recover()
		if r == nil {
			t.Fatalf("no panic, want one mentioning %q", want)
		}
		if msg := fmtf("%v", r); !strings.Contains(msg, want) {
			t.Fatalf("panic %q, want one mentioning %q", msg, want)
		}
	}()
	fn()
}

// TestProbeWithoutDriver: Probe fails like Open on a machine without the
// driver, and succeeds on the emulator.
func TestProbe(t *testing.T) {
	if !driverPresent() && !onGPU() {
		t.Setenv("DISTILL_LIBCUDA", "")
		if _, err := Probe(); err == nil || !strings.Contains(err.Error(), "libcuda.so.1") {
			t.Fatalf("Probe without a driver: %v", err)
		}
	}
	if !onGPU() {
		useEmu(t)
	}
	info, err := Probe()
	if err != nil || info.Major < 8 {
		t.Fatalf("Probe: %+v %v", info, err)
	}
}
