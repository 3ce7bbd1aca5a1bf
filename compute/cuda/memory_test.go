package cuda

import (
	"fmt"
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

// TestMemoryCap: Options.MemoryCap (and $DISTILL_CUDA_MEMORY_CAP) leaves
// the process that much of the device: MemInfo and Info report it, an
// allocation past what is left fails as out of memory, and Close gives
// the hold back. A cap at or above the device's memory, or an unreadable
// one, is refused by name. (The emulated device is the whole test
// process's: the cap is set above what the other tests hold.)
func TestMemoryCap(t *testing.T) {
	if !onGPU() {
		useEmu(t)
	}
	open := func(opt Options) *Backend {
		t.Helper()
		opt.KernelCache = kernelCacheForTests(t)
		b, err := Open(opt)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		return b
	}
	whole := open(Options{})
	free0, total0 := whole.MemInfo()
	capBytes := total0 - free0 + 2<<30 // 2 GiB more than in use
	if capBytes >= total0 {
		t.Skipf("the device has %d bytes free; the test caps it 2 GiB above what is in use", free0)
	}
	be := open(Options{MemoryCap: capBytes})
	free, total := be.MemInfo()
	if total != capBytes || free > 2<<30 || free < 1<<30 {
		t.Fatalf("capped at %d bytes (2 GiB above the %d in use): MemInfo free %d, total %d; want total %d and free about 2 GiB", capBytes, total0-free0, free, total, capBytes)
	}
	if got := be.Info().TotalMem; got != capBytes {
		t.Fatalf("capped at %d: Info().TotalMem %d", capBytes, got)
	}
	if f, _ := whole.MemInfo(); f > free0-(total0-capBytes) {
		t.Fatalf("an uncapped backend of the same process sees %d bytes free: the hold of %d bytes is not taken", f, total0-capBytes)
	}
	small := be.New(compute.F32, int(free-(256<<20))/4) // all but 256 MiB of what is left fits
	mustPanic(t, "out of memory", func() { be.New(compute.F32, (512<<20)/4) })
	be.Free(small)
	be.Close()
	if f, _ := whole.MemInfo(); f < free0-(64<<20) {
		t.Fatalf("after Close, %d bytes free of %d before the cap: the hold was not given back", f, free0)
	}
	if _, err := Open(Options{MemoryCap: total0, KernelCache: kernelCacheForTests(t)}); err == nil || !strings.Contains(err.Error(), "nothing to cap") {
		t.Fatalf("a cap of the whole device: %v", err)
	}
	t.Setenv("DISTILL_CUDA_MEMORY_CAP", fmt.Sprint(capBytes+1<<30))
	env := open(Options{})
	if _, total := env.MemInfo(); total != capBytes+1<<30 {
		t.Fatalf("DISTILL_CUDA_MEMORY_CAP=%d: total %d", capBytes+1<<30, total)
	}
	env.Close()
	t.Setenv("DISTILL_CUDA_MEMORY_CAP", "80")
	if _, err := Open(Options{KernelCache: kernelCacheForTests(t)}); err == nil || !strings.Contains(err.Error(), "DISTILL_CUDA_MEMORY_CAP") || !strings.Contains(err.Error(), "80GiB") {
		t.Fatalf("DISTILL_CUDA_MEMORY_CAP=80: %v", err)
	}
}
