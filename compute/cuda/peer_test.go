package cuda

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"distill/compute"
)

// openOn opens a backend on GPU ord (the tests' kernel cache), closed
// with t.
func openOn(t *testing.T, ord int, logf func(string, ...any)) *Backend {
	t.Helper()
	b, err := Open(Options{Device: ord, KernelCache: kernelCacheForTests(t), Logf: logf})
	if err != nil {
		t.Fatalf("opening GPU %d: %v", ord, err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// TestCopyFromDevices: CopyFrom moves F32 and BF16 tensors between
// backends bit for bit on each path, and says which it took: two
// emulated GPUs with peer access (cuMemcpyPeerAsync), the same pair with
// the emulator's peer access off (through pinned host memory, in several
// chunks), two streams of one GPU. Writes after the copy on either side
// do not reach the other.
func TestCopyFromDevices(t *testing.T) {
	if onGPU() {
		t.Skip("several GPUs: emulated only (the suite's machine has one)")
	}
	useEmu(t)
	t.Setenv("DISTILL_EMU_DEVICES", "2")
	defer func(c int64) { stageChunk = c }(stageChunk)
	stageChunk = 4096
	r := rand.New(rand.NewPCG(3, 4))
	for _, c := range []struct {
		name, peerEnv, want string
		dstOrd              int
	}{
		{"peer", "1", pathPeer, 1},
		{"host", "0", pathHost, 1},
		{"same GPU", "1", pathSameGPU, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("DISTILL_EMU_PEER", c.peerEnv)
			var log []string
			logf := func(f string, a ...any) { log = append(log, f) }
			src, dst := openOn(t, 0, nil), openOn(t, c.dstOrd, logf)
			if p := dst.PeerPath(src); p != c.want {
				t.Fatalf("path %q, want %q", p, c.want)
			}
			for _, dt := range []compute.DType{compute.F32, compute.BF16} {
				vals := randF32(r, 5000)
				s := src.New(dt, len(vals))
				src.WriteF32(s, vals)
				d := dst.New(dt, len(vals)+3)
				compute.CopyAcross(dst, d, src, s)
				src.WriteF32(s, make([]float32, len(vals))) // the copy is done: this must not reach d
				want, got := make([]float32, len(vals)), make([]float32, len(vals)+3)
				if dt == compute.BF16 {
					for i, v := range vals {
						want[i] = compute.BF16ToF32(compute.F32ToBF16(v))
					}
				} else {
					copy(want, vals)
				}
				dst.ReadF32(d, got)
				if !slices.Equal(got[:len(vals)], want) || got[len(vals)] != 0 {
					t.Errorf("%v: the copy differs from the source", dt)
				}
				src.Free(s)
				dst.Free(d)
			}
			if c.want != pathSameGPU && !slices.ContainsFunc(log, func(l string) bool { return strings.Contains(l, "copies from GPU") }) {
				t.Errorf("no log line says how the copies go: %q", log)
			}
		})
	}
}

// TestEmuDeviceIsolation: the emulator holds every device to its own
// memory: a copy or a kernel on GPU 1 touching GPU 0's memory fails,
// naming both, until GPU 0's pool grants GPU 1 access.
func TestEmuDeviceIsolation(t *testing.T) {
	if onGPU() {
		t.Skip("the emulator's checks")
	}
	useEmu(t)
	t.Setenv("DISTILL_EMU_DEVICES", "2")
	t.Setenv("DISTILL_EMU_PEER", "1")
	b0, b1 := openOn(t, 0, nil), openOn(t, 1, nil)
	// Grants last as long as the process (an earlier test's may stand):
	// revoke GPU 1's access to GPU 0's pool first.
	if err := b0.setPoolAccess(1, 0); err != nil {
		t.Fatal(err)
	}
	x0, x1 := b0.New(compute.F32, 64), b1.New(compute.F32, 64)
	p0, p1 := x0.(*tensor).p, x1.(*tensor).p
	func() { // New's zeroing on GPU 0 is done before GPU 1 reads x0
		defer b0.enter()()
		b0.sync()
	}()
	try := func(f func()) (msg string) {
		defer func() {
			if r := recover(); r != nil {
				msg = fmtf("%v", r)
			}
		}()
		func() {
			defer b1.enter()()
			f()
			b1.sync()
		}()
		return ""
	}
	copyD := func() { b1.copyD(p1, p0, 256) }
	kernel := func() { b1.ew("k_add", 64, dptr(p1), dptr(p0), int64(64)) }
	for _, f := range []func(){copyD, kernel} {
		if msg := try(f); !strings.Contains(msg, "device 0's memory, which device 1 may not reach") {
			t.Errorf("GPU 1 reading GPU 0's memory: %q, want an error naming both", msg)
		}
	}
	if p := b1.PeerPath(b0); p != pathPeer {
		t.Fatalf("path %q", p)
	}
	for _, f := range []func(){copyD, kernel} {
		if msg := try(f); msg != "" {
			t.Errorf("with access granted: %s", msg)
		}
	}
}
