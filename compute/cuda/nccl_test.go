package cuda

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"distill/compute"
	"distill/compute/cuda/cudaemu"
)

// The collectives' tests. On the emulator, NCCL is its stand-in
// (testdata/emu/emu_nccl.cpp) and the ranks of a group are processes of
// this test binary (TestNCCLRank, started by runRanks), or goroutines with
// a backend each (TestNCCLThreads, the join errors). With
// DISTILL_CUDA_TEST=gpu the library is the real NCCL (DISTILL_LIBNCCL, as
// scripts/gpu-suite.sh finds it) and the ranks share the one GPU, which
// NCCL refuses for two ranks: those tests then skip, saying so, and the
// single-rank test exercises the binding.

// ncclRankVar, set, makes TestNCCLRank a rank: "rank/size/case/hex id".
const ncclRankVar = "DISTILL_NCCL_TEST_RANK"

// ncclSharedGPU marks a rank's output when NCCL refused the group's ranks
// sharing one GPU.
const ncclSharedGPU = "NCCL refused ranks sharing one GPU:"

// ncclSlotBytes shrinks the emulator's staging slots (64 floats), so that
// the sizes below cross many of its steps.
const ncclSlotBytes = "256"

// ncclSizes are the element counts the operations run on: 0, around the
// emulator's chunks (64 floats; 21 and 32 for a reduce-scatter of 3 and 2
// ranks), and multiples of nothing.
var ncclSizes = []int{0, 1, 5, 21, 63, 64, 65, 127, 200, 1001}

// useNCCL points DISTILL_LIBNCCL at the emulator, unless the tests run on
// the GPU (then it names the real library, or the search finds it).
func useNCCL(t testing.TB) {
	t.Helper()
	if onGPU() {
		return
	}
	useEmu(t)
	lib, err := cudaemu.Library()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("DISTILL_LIBNCCL", lib)
	t.Setenv("DISTILL_EMU_NCCL_SLOT_BYTES", ncclSlotBytes)
}

// ncclBackend opens the backend under test with NCCL reachable.
func ncclBackend(t testing.TB) *Backend {
	t.Helper()
	useNCCL(t)
	return testBackend(t)
}

// join makes a group of one on b.
func joinOne(t *testing.T, b *Backend) compute.Collective {
	t.Helper()
	id, err := b.NewCollectiveID()
	if err != nil {
		t.Fatal(err)
	}
	c, err := b.JoinCollective(id, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestNCCLSingleRank: every operation in a group of one, the binding
// exercised end to end (on the GPU: the real NCCL).
func TestNCCLSingleRank(t *testing.T) {
	b := ncclBackend(t)
	c := joinOne(t, b)
	if c.Rank() != 0 || c.Size() != 1 {
		t.Fatalf("rank %d of %d, want 0 of 1", c.Rank(), c.Size())
	}
	ncclOps(t, b, c)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("a second Close: %v", err)
	}
}

// TestNCCLRanks: groups of 2 and 3 processes run every operation
// (ncclOps), each rank checking its results.
func TestNCCLRanks(t *testing.T) {
	for _, size := range []int{2, 3} {
		t.Run(strconv.Itoa(size), func(t *testing.T) {
			for r, out := range runRanks(t, size, "ops") {
				if !strings.Contains(out, "--- PASS: TestNCCLRank") {
					t.Errorf("rank %d did not pass:\n%s", r, out)
				}
			}
		})
	}
}

// TestNCCLMismatch: ranks issuing different operations (here: counts) get
// an error on every rank, not a hang or a wrong sum (the emulator checks
// what every rank issued at each step; NCCL itself does not).
func TestNCCLMismatch(t *testing.T) {
	if onGPU() {
		t.Skip("the emulator's check: NCCL does not compare the ranks' calls")
	}
	for r, out := range runRanks(t, 3, "mismatch") {
		if !strings.Contains(out, "--- PASS: TestNCCLRank") {
			t.Errorf("rank %d did not pass:\n%s", r, out)
		}
	}
}

// TestNCCLDeadPeer: a rank that exits makes its peers' next collective an
// error naming it (well before DISTILL_NCCL_TIMEOUT, an upper bound here).
func TestNCCLDeadPeer(t *testing.T) {
	if onGPU() {
		t.Skip("needs two ranks: NCCL refuses two on one GPU")
	}
	outs := runRanks(t, 2, "dead", "DISTILL_NCCL_TIMEOUT=120s")
	if !strings.Contains(outs[0], "--- PASS: TestNCCLRank") {
		t.Errorf("rank 0 did not pass:\n%s", outs[0])
	}
	if !strings.Contains(outs[1], "rank 1: exiting") {
		t.Errorf("rank 1 did not exit as planned:\n%s", outs[1])
	}
}

// runRanks runs size processes of this test binary, TestNCCLRank each, as
// the ranks of one group made here, with case cas and env added; it
// returns each rank's output. Ranks that print ncclSharedGPU skip t.
func runRanks(t *testing.T, size int, cas string, env ...string) []string {
	t.Helper()
	b := ncclBackend(t)
	id, err := b.NewCollectiveID()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	outs := make([]string, size)
	var wg sync.WaitGroup
	for r := range size {
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestNCCLRank$", "-test.v", "-test.count=1")
		cmd.Env = append(append(os.Environ(), fmt.Sprintf("%s=%d/%d/%s/%s", ncclRankVar, r, size, cas, hex.EncodeToString(id[:]))), env...)
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := cmd.CombinedOutput()
			outs[r] = string(out)
			if err != nil {
				outs[r] += fmt.Sprintf("\n(rank %d: %v)", r, err)
			}
		}()
	}
	wg.Wait()
	for _, out := range outs {
		if i := strings.Index(out, ncclSharedGPU); i >= 0 {
			line, _, _ := strings.Cut(out[i:], "\n")
			t.Skipf("%s; TestNCCLSingleRank exercises the binding instead", line)
		}
	}
	return outs
}

// TestNCCLRank is one rank of runRanks's group; skipped unless it set
// ncclRankVar.
func TestNCCLRank(t *testing.T) {
	spec := os.Getenv(ncclRankVar)
	if spec == "" {
		t.Skip("a rank of the groups of TestNCCLRanks, TestNCCLMismatch and TestNCCLDeadPeer, which start it")
	}
	f := strings.Split(spec, "/")
	if len(f) != 4 {
		t.Fatalf("%s=%q: want rank/size/case/id", ncclRankVar, spec)
	}
	rank, err1 := strconv.Atoi(f[0])
	size, err2 := strconv.Atoi(f[1])
	raw, err3 := hex.DecodeString(f[3])
	if err := errors.Join(err1, err2, err3); err != nil || len(raw) != len(compute.CollectiveID{}) {
		t.Fatalf("%s=%q: %v", ncclRankVar, spec, err)
	}
	var id compute.CollectiveID
	copy(id[:], raw)
	b := ncclBackend(t)
	c, err := b.JoinCollective(id, rank, size)
	if err != nil {
		var ne *NCCLError
		if onGPU() && errors.As(err, &ne) && ncclResultName(ne.Result) == "ncclInvalidUsage" {
			fmt.Println(ncclSharedGPU, err)
			t.Skip(err)
		}
		t.Fatal(err)
	}
	switch f[2] {
	case "ops":
		ncclOps(t, b, c)
	case "mismatch":
		// Rank 1 all-reduces one element more than the others.
		n := 10 + min(rank, 1)
		x := b.New(compute.F32, n)
		mustPanic(t, "ranks disagree", func() { c.AllReduceSum(x, n) })
		mustPanic(t, "ncclInvalidUsage", func() { c.AllReduceSum(x, 1) })
	case "dead":
		if rank == 1 {
			fmt.Println("rank 1: exiting")
			os.Exit(3)
		}
		x := b.New(compute.F32, 4)
		mustPanic(t, "rank 1 (pid", func() { c.AllReduceSum(x, 4) })
	default:
		t.Fatalf("unknown case %q", f[2])
	}
	if err := c.Close(); err != nil && f[2] == "ops" {
		t.Fatal(err)
	}
}

// ncclOps runs every operation of c on sizes crossing the emulator's
// chunks, each rank checking its results: exactly where the sums are of
// small integers (any order gives the same), within rounding for random
// values against a float64 sum, and interleaved with kernels on the same
// stream (rank-dependent Scales before and after, which a reordering
// would show).
func ncclOps(t *testing.T, b *Backend, c compute.Collective) {
	t.Helper()
	r, size := c.Rank(), c.Size()
	tri := size * (size + 1) / 2 // Σ (q+1)
	s2 := 0                      // Σ (q+1)(q+2)
	for q := range size {
		s2 += (q + 1) * (q + 2)
	}
	exact := func(what string, n int, got []float32, want func(i int) float32) {
		t.Helper()
		for i, g := range got {
			if w := want(i); g != w {
				t.Fatalf("rank %d of %d, n=%d: %s[%d] = %v, want %v", r, size, n, what, i, g, w)
			}
		}
	}
	for _, n := range ncclSizes {
		// All-reduce between Scales by r+2 before and r+1 after.
		x := make([]float32, n)
		for i := range x {
			x[i] = float32((i%7 + 1) * (r + 1))
		}
		xt := b.FromF32(x)
		b.Scale(xt, n, float32(r+2))
		c.AllReduceSum(xt, n)
		b.Scale(xt, n, float32(r+1))
		exact("AllReduceSum", n, readF32(b, xt, n), func(i int) float32 { return float32((i%7 + 1) * s2 * (r + 1)) })

		// Reduce-scatter into a destination with a tail it must not touch.
		src := make([]float32, size*n)
		for j := range size {
			for i := range n {
				src[j*n+i] = float32((r+1)*(j+1) + i%5)
			}
		}
		srcT, dst := b.FromF32(src), b.FromF32(fill(n+2, -1))
		c.ReduceScatterSum(dst, srcT, n)
		exact("ReduceScatterSum", n, readF32(b, dst, n+2), func(i int) float32 {
			if i >= n {
				return -1
			}
			return float32((r+1)*tri + size*(i%5))
		})
		// In place: the destination is this rank's part of the source.
		srcT = b.FromF32(src)
		in := b.View(srcT, r*n, n)
		c.ReduceScatterSum(in, srcT, n)
		exact("ReduceScatterSum in place", n, readF32(b, in, n), func(i int) float32 { return float32((r+1)*tri + size*(i%5)) })

		// All-gather, then in place (the source is this rank's part).
		g := make([]float32, n)
		for i := range g {
			g[i] = float32(1000*r + i%1000)
		}
		gathered := func(i int) float32 {
			if i >= size*n {
				return -1
			}
			return float32(1000*(i/n) + i%n%1000)
		}
		gdst := b.FromF32(fill(size*n+1, -1))
		c.AllGather(gdst, b.FromF32(g), n)
		exact("AllGather", n, readF32(b, gdst, size*n+1), gathered)
		gdst = b.FromF32(fill(size*n, -1))
		b.WriteF32(b.View(gdst, r*n, n), g)
		c.AllGather(gdst, b.View(gdst, r*n, n), n)
		exact("AllGather in place", n, readF32(b, gdst, size*n), gathered)
		// BF16 (ncclBfloat16; values BF16 holds exactly), then in place.
		h := make([]float32, n)
		for i := range h {
			h[i] = float32(16*r + i%16)
		}
		halves := func(i int) float32 { return float32(16*(i/n) + i%n%16) }
		hsrc, hdst := b.New(compute.BF16, n), b.New(compute.BF16, size*n)
		b.WriteF32(hsrc, h)
		c.AllGather(hdst, hsrc, n)
		exact("AllGather BF16", n, readF32(b, hdst, size*n), halves)
		hdst = b.New(compute.BF16, size*n)
		b.WriteF32(b.View(hdst, r*n, n), h)
		c.AllGather(hdst, b.View(hdst, r*n, n), n)
		exact("AllGather BF16 in place", n, readF32(b, hdst, size*n), halves)

		// Broadcast from a root that moves with n.
		root := n % size
		bc := make([]float32, n)
		for i := range bc {
			bc[i] = float32(100*r + i%3)
		}
		bt := b.FromF32(bc)
		c.Broadcast(bt, n, root)
		exact("Broadcast", n, readF32(b, bt, n), func(i int) float32 { return float32(100*root + i%3) })

		// Random values: within rounding of the float64 sum (every rank
		// makes every rank's inputs from the same seeds).
		var want64, abs []float64 = make([]float64, n), make([]float64, n)
		var mine []float32
		for q := range size {
			v := randF32(rand.New(rand.NewPCG(uint64(n), uint64(q))), n)
			for i, e := range v {
				want64[i] += float64(e)
				abs[i] += math.Abs(float64(e))
			}
			if q == r {
				mine = v
			}
		}
		rt := b.FromF32(mine)
		c.AllReduceSum(rt, n)
		for i, got := range readF32(b, rt, n) {
			if d := math.Abs(float64(got) - want64[i]); d > float64(size)*abs[i]*0x1p-23 {
				t.Fatalf("rank %d of %d, n=%d: random AllReduceSum[%d] = %v, want %v (|Δ| %.3g > %d ulps of Σ|x|)", r, size, n, i, got, want64[i], d, size*2)
			}
		}
		for _, u := range []compute.Tensor{xt, srcT, dst, gdst, bt, rt} {
			b.Free(u)
		}
	}

	// A group of two all-reduces (Grouper): both complete at ncclGroupEnd.
	g, ok := c.(Grouper)
	if !ok {
		t.Fatalf("%T is no Grouper", c)
	}
	a1, a2 := b.FromF32(fill(70, float32(r+1))), b.FromF32(fill(3, float32(2*r)))
	g.Group(func() {
		c.AllReduceSum(a1, 70)
		c.AllReduceSum(a2, 3)
	})
	exact("grouped AllReduceSum", 70, readF32(b, a1, 70), func(int) float32 { return float32(tri) })
	exact("grouped AllReduceSum", 3, readF32(b, a2, 3), func(int) float32 { return float32(2 * (tri - size)) })
}

func fill(n int, v float32) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = v
	}
	return s
}

// TestNCCLMisuse: wrong types, sizes, roots and overlaps panic with a
// message naming the operand, before NCCL is called; so does a closed
// collective.
func TestNCCLMisuse(t *testing.T) {
	b := ncclBackend(t)
	c := joinOne(t, b)
	f4, bf := b.New(compute.F32, 4), b.New(compute.BF16, 4)
	mustPanic(t, "AllReduceSum tensor is bf16", func() { c.AllReduceSum(bf, 4) })
	mustPanic(t, "AllReduceSum tensor has 4 elements, the call needs 5", func() { c.AllReduceSum(f4, 5) })
	mustPanic(t, "AllReduceSum of -1 elements", func() { c.AllReduceSum(f4, -1) })
	mustPanic(t, "ReduceScatterSum source has 4 elements, the call needs 5", func() { c.ReduceScatterSum(b.New(compute.F32, 5), f4, 5) })
	mustPanic(t, "ReduceScatterSum destination is bf16", func() { c.ReduceScatterSum(bf, f4, 4) })
	mustPanic(t, "AllGather destination has 4 elements, the call needs 5", func() { c.AllGather(f4, b.New(compute.F32, 5), 5) })
	mustPanic(t, "AllGather source is i32", func() { c.AllGather(f4, b.FromI32(make([]int32, 4)), 4) })
	mustPanic(t, "AllGather of a bf16 source into a f32 destination", func() { c.AllGather(f4, bf, 4) })
	bigBF := b.New(compute.BF16, 8)
	mustPanic(t, "overlap", func() { c.AllGather(b.View(bigBF, 0, 4), b.View(bigBF, 2, 4), 4) })
	mustPanic(t, "Broadcast from root 1 in a group of 1", func() { c.Broadcast(f4, 4, 1) })
	mustPanic(t, "Broadcast tensor is bf16", func() { c.Broadcast(bf, 4, 0) })
	big := b.New(compute.F32, 8)
	mustPanic(t, "overlap", func() { c.ReduceScatterSum(b.View(big, 1, 4), b.View(big, 0, 4), 4) })
	mustPanic(t, "overlap", func() { c.AllGather(b.View(big, 0, 4), b.View(big, 2, 4), 4) })
	mustPanic(t, "another backend", func() { c.AllReduceSum(oracle.New(compute.F32, 4), 4) })
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	mustPanic(t, "closed collective", func() { c.AllReduceSum(f4, 4) })
}

// TestNCCLShadows: a collective that writes a parameter makes its BF16
// shadow stale (shadow.go), as a kernel's write does.
func TestNCCLShadows(t *testing.T) {
	b := ncclBackend(t)
	c := joinOne(t, b)
	defer c.Close()
	const n = 8
	p := b.FromF32(fill(2*n, 1))
	stale := func(op string, f func()) {
		t.Helper()
		var r *region
		func() {
			defer b.enter()()
			pt := p.(*tensor)
			r = b.register(pt.p, n)
			b.shadowOf(pt, n)
		}()
		if !r.current() {
			t.Fatal("the shadow is not current after it was made")
		}
		f()
		if r.current() {
			t.Fatalf("%s wrote the parameter, and its shadow is still current", op)
		}
	}
	stale("AllReduceSum", func() { c.AllReduceSum(p, n) })
	stale("Broadcast", func() { c.Broadcast(p, n, 0) })
	stale("ReduceScatterSum", func() { c.ReduceScatterSum(p, b.FromF32(fill(n, 2)), n) })
	stale("AllGather", func() { c.AllGather(p, b.FromF32(fill(n, 2)), n) })
}

// TestNCCLThreads: the ranks of a group as goroutines of one process, a
// backend each (the emulator's stand-in runs threads too). The emulator
// is single-threaded beyond its collectives, so only the collectives run
// concurrently; everything else runs one rank at a time.
func TestNCCLThreads(t *testing.T) {
	if onGPU() {
		t.Skip("two ranks of one process on one GPU: NCCL refuses it")
	}
	const size, n = 3, 150
	useNCCL(t)
	bs := make([]*Backend, size)
	for r := range bs {
		bs[r] = testBackend(t)
	}
	id, err := bs[0].NewCollectiveID()
	if err != nil {
		t.Fatal(err)
	}
	cs := make([]compute.Collective, size)
	each := func(f func(r int) error) {
		t.Helper()
		errs := make([]error, size)
		var wg sync.WaitGroup
		for r := range size {
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() {
					if p := recover(); p != nil {
						errs[r] = fmt.Errorf("rank %d panicked: %v", r, p)
					}
				}()
				errs[r] = f(r)
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
	}
	each(func(r int) (err error) {
		cs[r], err = bs[r].JoinCollective(id, r, size)
		return err
	})
	xs, gs := make([]compute.Tensor, size), make([]compute.Tensor, size)
	for r, b := range bs {
		xs[r] = b.FromF32(fill(n, float32(r+1)))
		gs[r] = b.New(compute.F32, size*n)
	}
	each(func(r int) error {
		cs[r].AllReduceSum(xs[r], n)
		cs[r].AllGather(gs[r], xs[r], n)
		return nil
	})
	for r, b := range bs {
		for i, v := range readF32(b, gs[r], size*n) {
			if v != 6 {
				t.Fatalf("rank %d: element %d = %v, want 6 (1+2+3)", r, i, v)
			}
		}
		if err := cs[r].Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestNCCLJoinErrors: a group that cannot form is an error on every rank
// that joined it, never a hang: a wrong size, a rank joining twice, a rank
// out of range, an id whose group has formed, a peer that never comes
// (DISTILL_NCCL_TIMEOUT, the library's timeout and JoinCollective's own).
func TestNCCLJoinErrors(t *testing.T) {
	b0 := ncclBackend(t)
	if _, err := b0.JoinCollective(compute.CollectiveID{}, 2, 2); err == nil || !strings.Contains(err.Error(), "want 0 <= rank < size") {
		t.Errorf("rank 2 of 2: %v, want an error", err)
	}
	t.Run("timeout", func(t *testing.T) {
		t.Setenv("DISTILL_NCCL_TIMEOUT", "1s")
		id, _ := b0.NewCollectiveID()
		if _, err := b0.JoinCollective(id, 0, 2); err == nil || !strings.Contains(err.Error(), "DISTILL_NCCL_TIMEOUT") {
			t.Fatalf("rank 0 of 2 alone: %v, want an error naming DISTILL_NCCL_TIMEOUT", err)
		}
	})
	if onGPU() {
		return // the rest needs two ranks, or is the emulator's
	}
	b1 := testBackend(t)
	t.Run("deadline", func(t *testing.T) {
		// The library waits longer than JoinCollective: its own deadline.
		t.Setenv("DISTILL_NCCL_TIMEOUT", "1s")
		t.Setenv("DISTILL_EMU_NCCL_TIMEOUT", "60s")
		id, _ := b0.NewCollectiveID()
		_, err := b0.JoinCollective(id, 0, 2)
		if err == nil || !strings.Contains(err.Error(), "did not return within 1s (DISTILL_NCCL_TIMEOUT)") {
			t.Fatalf("rank 0 of 2 alone: %v, want JoinCollective's deadline", err)
		}
		// Rank 1 comes late: the group forms, and the thread left in
		// ncclCommInitRank aborts rank 0's communicator.
		c, err := b1.JoinCollective(id, 1, 2)
		if err != nil {
			t.Fatal(err)
		}
		x := b1.New(compute.F32, 1)
		mustPanic(t, "rank 0 aborted its communicator", func() { c.AllReduceSum(x, 1) })
		c.Close()
	})
	t.Run("formed", func(t *testing.T) {
		id, _ := b0.NewCollectiveID()
		c, err := b0.JoinCollective(id, 0, 1)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := b0.JoinCollective(id, 0, 1); err == nil || !strings.Contains(err.Error(), "has formed or failed already") {
			t.Fatalf("joining a formed group: %v", err)
		}
	})
	for _, tc := range []struct {
		name         string
		ranks, sizes [2]int
		want         string
	}{
		{"size", [2]int{0, 1}, [2]int{2, 3}, "joined a group of"},
		{"duplicate", [2]int{0, 0}, [2]int{2, 2}, "joined twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("DISTILL_NCCL_TIMEOUT", "60s") // an upper bound: the errors come at once
			id, err := b0.NewCollectiveID()
			if err != nil {
				t.Fatal(err)
			}
			var errs [2]error
			var wg sync.WaitGroup
			for i, b := range []*Backend{b0, b1} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					var c compute.Collective
					if c, errs[i] = b.JoinCollective(id, tc.ranks[i], tc.sizes[i]); c != nil {
						c.Close()
					}
				}()
			}
			wg.Wait()
			for i, err := range errs {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("rank %d of %d: %v, want an error mentioning %q", tc.ranks[i], tc.sizes[i], err, tc.want)
				}
			}
		})
	}
}

// TestNCCLLibrary: a missing libnccl, or a library without NCCL's
// symbols, is an error naming DISTILL_LIBNCCL or the symbols.
func TestNCCLLibrary(t *testing.T) {
	b := testBackend(t)
	t.Setenv("DISTILL_LIBNCCL", "/nonexistent/libnccl.so.2")
	_, err := b.NewCollectiveID()
	if err == nil || !strings.Contains(err.Error(), "/nonexistent/libnccl.so.2 (from DISTILL_LIBNCCL)") {
		t.Fatalf("NewCollectiveID without NCCL: %v, want an error naming DISTILL_LIBNCCL", err)
	}
	if _, err := b.JoinCollective(compute.CollectiveID{}, 0, 1); err == nil || !strings.Contains(err.Error(), "DISTILL_LIBNCCL") {
		t.Fatalf("JoinCollective without NCCL: %v, want an error naming DISTILL_LIBNCCL", err)
	}
	t.Setenv("DISTILL_LIBNCCL", "libc.so.6")
	if _, err := b.NewCollectiveID(); err == nil || !strings.Contains(err.Error(), "lacks ncclAllGather, ncclAllReduce") {
		t.Fatalf("NewCollectiveID with libc as NCCL: %v, want an error naming the missing symbols", err)
	}
}
