package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"distill/compute"
)

func TestElementwiseGrid(t *testing.T) {
	for _, c := range []struct {
		n    int64
		want int
	}{{0, 1}, {1, 1}, {256, 1}, {257, 2}, {256 * 65536, 65536}, {1 << 40, 65536}} {
		if g := elementwiseGrid(c.n); g != [3]int{c.want, 1, 1} {
			t.Errorf("elementwiseGrid(%d) = %v, want %d blocks", c.n, g, c.want)
		}
	}
}

func TestRMSNormLaunch(t *testing.T) {
	if l := rmsnormLaunch(9, 1024); l.kernel != "k_rmsnorm_warp" || l.grid[0] != 2 || l.block != 256 {
		t.Errorf("dim 1024: %+v, want the warp kernel, 2 blocks of 8 rows", l)
	}
	if l := rmsnormLaunch(9, 1025); l.kernel != "k_rmsnorm_block" || l.grid[0] != 9 {
		t.Errorf("dim 1025: %+v, want the block kernel, one block a row", l)
	}
}

func TestRoPELaunch(t *testing.T) {
	if _, err := ropeLaunch(3, 2, 7); err == nil {
		t.Error("odd head_dim accepted")
	}
	if _, err := ropeLaunch(3, 2, 0); err == nil || !strings.Contains(err.Error(), "even head_dim") {
		t.Errorf("head_dim 0: %v", err)
	}
	if l, err := ropeLaunch(3, 2, 2048); err != nil || l.kernel != "k_rope_table" || l.block != 256 {
		t.Errorf("head_dim 2048 (no shared memory, so no limit): %+v %v", l, err)
	}
	if l, err := ropeLaunch(5, 32, 128); err != nil || l.grid[0] != 5 || l.block != 256 || l.block%32 != 0 {
		t.Errorf("rope 5x32x128: %+v %v", l, err)
	}
	if l, _ := ropeLaunch(5, 1, 8); l.block != 32 {
		t.Errorf("a tiny head gets %d threads, want one warp", l.block)
	}
}

func TestAttentionLaunch(t *testing.T) {
	for _, c := range []struct {
		mode   attnMode
		hd     int
		kernel string
	}{{"", 64, "k_attn_mma64"}, {"auto", 128, "k_attn_mma128"}, {"", 80, "k_attn_simt"}, {"simt", 128, "k_attn_simt"}, {"", 256, "k_attn_simt"}} {
		_, a, err := attentionLaunch(c.mode, 100, 3, 8, 2, c.hd)
		block, smem := 128, 0
		if c.kernel != "k_attn_simt" {
			block, smem = mmaThreads, mmaFwdSmem(c.hd)
		}
		if err != nil || a.kernel != c.kernel || a.grid[1] != 8 || a.block != block || a.smem != smem {
			t.Errorf("mode %q hd %d: %+v %v, want %s, %d threads, %d bytes of shared memory", c.mode, c.hd, a, err, c.kernel, block, smem)
		}
	}
	for _, c := range []struct {
		mode                         attnMode
		tokens, nSeq, nHead, nKV, hd int
		want                         string
	}{{"mma", 10, 1, 4, 4, 80, "64 or 128"}, {"", 10, 1, 4, 3, 64, "kv heads"}, {"", 10, 1, 4, 2, 512, "1..256"}, {"", 3, 5, 4, 2, 64, "samples"}} {
		if _, _, err := attentionLaunch(c.mode, c.tokens, c.nSeq, c.nHead, c.nKV, c.hd); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error mentioning %q", c, err, c.want)
		}
	}
	// The grid bounds the tiles of every packing, by less than one tile a
	// sample.
	r := rand.New(rand.NewPCG(1, 1))
	for trial := 0; trial < 200; trial++ {
		nSeq := 1 + r.IntN(50)
		tokens, tiles := 0, 0
		for s := 0; s < nSeq; s++ {
			l := 1 + r.IntN(300)
			tokens += l
			tiles += (l + mmaBQ - 1) / mmaBQ
		}
		_, a, err := attentionLaunch("", tokens, nSeq, 4, 4, 64)
		if err != nil || a.grid[0] < tiles || a.grid[0] >= tiles+nSeq {
			t.Fatalf("%d samples, %d tokens, %d tiles: grid %d (%v)", nSeq, tokens, tiles, a.grid[0], err)
		}
	}
}

// TestAttentionBackwardLaunch: the tensor-core chain for head_dim 64 and
// 128 (dq over query tiles and heads, dkv over key tiles and kv heads, one
// tile size for both), the SIMT pair otherwise; the tensor-core kernels'
// shared memory fits an A100's opt-in limit (163 KiB; an H100 allows 227).
func TestAttentionBackwardLaunch(t *testing.T) {
	for _, c := range []struct {
		mode attnMode
		hd   int
		mma  bool
	}{{"", 64, true}, {"mma", 128, true}, {"simt", 64, false}, {"", 80, false}, {"auto", 256, false}} {
		p, err := attentionBackwardLaunch(c.mode, 1000, 3, 8, 2, c.hd)
		tiles := (1000 + 3*(p.bq-1)) / p.bq
		switch {
		case err != nil:
			t.Errorf("%+v: %v", c, err)
		case p.mma != c.mma:
			t.Errorf("%+v: mma %v", c, p.mma)
		case c.mma && (p.bq != mmaBQ || p.dq.kernel != fmt.Sprintf("k_attn_bwd_dq_mma%d", c.hd) || p.dkv.kernel != fmt.Sprintf("k_attn_bwd_dkv_mma%d", c.hd) ||
			p.fwd.kernel != fmt.Sprintf("k_attn_mma%d", c.hd) || p.fwd.smem != mmaFwdSmem(c.hd)):
			t.Errorf("%+v: %+v", c, p)
		case c.mma && (p.dq.block != mmaThreads || p.dkv.block != mmaThreads || p.fwd.block != mmaThreads):
			t.Errorf("%+v: blocks of %d, %d, %d threads, want %d", c, p.fwd.block, p.dq.block, p.dkv.block, mmaThreads)
		case c.mma && (p.dq.smem > 166912 || p.dkv.smem > 166912 || p.fwd.smem > 166912):
			t.Errorf("%+v: %d, %d and %d bytes of shared memory exceed an A100's 166912", c, p.fwd.smem, p.dq.smem, p.dkv.smem)
		case !c.mma && (p.bq != bwdBQ || p.dq.kernel != "k_attn_bwd_dq" || p.dkv.kernel != "k_attn_bwd_dkv" || p.dq.block != 128):
			t.Errorf("%+v: %+v", c, p)
		case p.dq.grid != [3]int{tiles, 8, 1} || p.dkv.grid != [3]int{tiles, 2, 1}:
			t.Errorf("%+v: grids %v and %v, want %d tiles by 8 heads and by 2 kv heads", c, p.dq.grid, p.dkv.grid, tiles)
		}
	}
	if dq, dkv := mmaBwdSmem(128); dq != (2*128+4*mmaDqBK)*136*2 || dkv != (2*128+4*mmaDkvBQ)*136*2+4*mmaDkvBQ*4 {
		t.Errorf("mmaBwdSmem(128) = %d, %d", dq, dkv)
	}
	if _, err := attentionBackwardLaunch("mma", 10, 1, 4, 4, 80); err == nil || !strings.Contains(err.Error(), "64 or 128") {
		t.Errorf("mma with head_dim 80: %v", err)
	}
}

// TestAttentionMMASteps runs the tensor-core kernels on samples long enough
// for three and more steps of every kernel's double-buffered pipeline
// (128-row tiles; steps of 64 keys in the forward and dq, of 64 queries
// per head in dkv), which the conformance tests' shorter emulator samples
// reach only partly: the forward and its lse, the backward with the
// forward's output (run twice: the same bits) and without it (O
// recomputed), against the CPU on the same BF16-rounded inputs, with the
// conformance tests' tolerances (TestAttentionConformance,
// TestAttentionBackwardConformance).
func TestAttentionMMASteps(t *testing.T) {
	be := testBackend(t)
	be.attn = "mma"
	defer func() { be.attn = "" }()
	r := rand.New(rand.NewPCG(61, 62))
	ac := newAttnCase(r, []int{300, 1, 129, 200}, 4, 2, 64)
	got, gotL := ac.run(be, ac.q, ac.k, ac.v)
	qr, _ := roundBF16(ac.q)
	kr, _ := roundBF16(ac.k)
	vr, _ := roundBF16(ac.v)
	want, wantL := ac.run(oracle, qr, kr, vr)
	closeTo(t, "attention mma vs cpu(bf16 q,k,v)", got, want, 8e-3, 2e-2)
	closeTo(t, "attention mma lse vs cpu(bf16 q,k)", gotL, wantL, 1e-4, 1e-5)

	nq, nk := ac.tokens*ac.nHead*ac.hd, ac.tokens*ac.nKV*ac.hd
	dout := randF32(r, nq)
	dr, _ := roundBF16(dout)
	scale := float32(1 / math.Sqrt(float64(ac.hd)))
	o, lse := ac.run(oracle, ac.q, ac.k, ac.v)
	back := func(be compute.Backend, q, k, v, dout, o []float32) (dq, dk, dv []float32) {
		gq, gk, gv := be.New(compute.F32, nq), be.New(compute.F32, nk), be.New(compute.F32, nk)
		for _, x := range []compute.Tensor{gq, gk, gv} {
			be.Zero(x)
		}
		var ot compute.Tensor
		if o != nil {
			ot = be.FromF32(o)
		}
		be.AttentionBackward(gq, gk, gv, be.FromF32(dout), be.FromF32(q), be.FromF32(k), be.FromF32(v), ot, be.FromF32(lse),
			be.FromI32(ac.starts), len(ac.lens), ac.maxLen, ac.tokens, ac.nHead, ac.nKV, ac.hd, scale)
		return readF32(be, gq, nq), readF32(be, gk, nk), readF32(be, gv, nk)
	}
	wq, wk, wv := back(oracle, qr, kr, vr, dr, o)
	atol, rtol := 2e-2*math.Sqrt(float64(ac.maxLen)/65), 2e-2
	for _, withO := range []bool{true, false} {
		oo := o
		if !withO {
			oo = nil
		}
		gq, gk, gv := back(be, ac.q, ac.k, ac.v, dout, oo)
		what := fmt.Sprintf("backward (forward's output %v)", withO)
		closeTo(t, what+" dq", gq, wq, atol, rtol)
		closeTo(t, what+" dk", gk, wk, atol, rtol)
		closeTo(t, what+" dv", gv, wv, atol, rtol)
		if withO {
			gq2, gk2, gv2 := back(be, ac.q, ac.k, ac.v, dout, oo)
			same(t, "dq", gq, gq2)
			same(t, "dk", gk, gk2)
			same(t, "dv", gv, gv2)
		}
	}
}

func TestPlanLMHead(t *testing.T) {
	if _, err := planLMHead(10, 64, 100, 101); err == nil {
		t.Error("k > vocab accepted")
	}
	for _, c := range []struct{ tokens, hidden, vocab, k int }{{1, 8, 1, 1}, {300, 24, 5000, 64}, {65536, 4096, 151936, 64}, {8192, 2048, 128256, 4096}} {
		p, err := planLMHead(c.tokens, c.hidden, c.vocab, c.k)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case p.cols%lmTile != 0 || p.cols > lmMaxCols:
			t.Errorf("%+v: cols %d, want a multiple of %d up to %d", c, p.cols, lmTile, lmMaxCols)
		case p.cols < min(c.vocab, lmMaxCols):
			t.Errorf("%+v: cols %d leave part of a small vocab out", c, p.cols)
		case p.rows < 1 || p.rows > c.tokens || p.rows > lmMaxRows:
			t.Errorf("%+v: rows %d", c, p.rows)
		case int64(p.rows)*int64(p.cols)*4 > lmTileBudget && p.rows > 1:
			t.Errorf("%+v: a %dx%d logit tile exceeds the %d-byte budget", c, p.rows, p.cols, lmTileBudget)
		case p.foldSmem != 8*(lmTile+c.k):
			t.Errorf("%+v: fold shared memory %d", c, p.foldSmem)
		case p.scratch != int64(p.rows)*int64(p.cols)*4+int64(p.rows)*int64(c.hidden)*2+int64(c.tokens)*16:
			t.Errorf("%+v: scratch %d", c, p.scratch)
		}
	}
}

func TestPlanMoE(t *testing.T) {
	p, err := planMoE([]int32{3, 0, 5, 2}, 5, 2)
	if err != nil {
		t.Fatal(err)
	}
	if want := []int32{0, 3, 3, 8, 10}; !equalI32(p.offsets, want) || p.rows != 10 || p.busiest != 5 {
		t.Fatalf("plan %+v, want offsets %v, 10 rows, busiest 5", p, want)
	}
	if _, err := planMoE([]int32{3, 1}, 3, 2); err == nil || !strings.Contains(err.Error(), "want tokens·top_k") {
		t.Errorf("counts that do not add up: %v", err)
	}
	if _, err := planMoE([]int32{-1, 7}, 3, 2); err == nil {
		t.Error("a negative count accepted")
	}
	if _, err := planMoE([]int32{4, 2}, 3, 2); err == nil {
		t.Error("an expert with more rows than tokens accepted")
	}
}

func equalI32(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestAttnPlanKernel runs k_attn_plan with more samples than its block has
// threads (the scan carries across chunks) against the host's prefix sums.
func TestAttnPlanKernel(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(2, 2))
	nSeq := 2500
	starts := []int32{0}
	want := []int32{0}
	for s := 0; s < nSeq; s++ {
		l := int32(1 + r.IntN(200))
		starts = append(starts, starts[s]+l)
		want = append(want, want[s]+(l+mmaBQ-1)/mmaBQ)
	}
	st := be.FromI32(starts)
	out := be.New(compute.I32, nSeq+1)
	func() {
		defer be.enter()()
		plan, _, err := attentionLaunch("", int(starts[nSeq]), nSeq, 1, 1, 64)
		if err != nil {
			t.Fatal(err)
		}
		be.launchKernel(plan, dptr(out.(*tensor).p), dptr(st.(*tensor).p), int32(nSeq), int32(mmaBQ))
	}()
	got := make([]int32, nSeq+1)
	be.ReadI32(out, got)
	if !equalI32(got, want) {
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("tile_start[%d] = %d, want %d", i, got[i], want[i])
			}
		}
	}
}

// TestLaunchArgumentsChecked: the emulator rejects arguments whose sizes do
// not match the kernel's parameters (an int where the kernel takes i64);
// the backend turns that into a panic naming the kernel.
func TestLaunchArgumentsChecked(t *testing.T) {
	be := testBackend(t)
	if be.checkParams == nil {
		t.Skip("a real driver does not check parameter sizes")
	}
	a := be.New(compute.F32, 4).(*tensor)
	defer func() {
		r := recover()
		if r == nil || !strings.Contains(r.(string), "k_add") || !strings.Contains(r.(string), "signature") {
			t.Fatalf("recovered %v, want a panic about k_add's signature", r)
		}
	}()
	defer be.enter()()
	be.ew("k_add", 4, dptr(a.p), dptr(a.p), int32(4)) // k_add takes i64 n
}
