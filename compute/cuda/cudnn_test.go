package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"distill/compute"
)

// cudnnBackend opens the backend under test with attention on cuDNN; on
// the emulator and in the GPU suite cuDNN must load (the emulator stands
// in for it), so a missing cuDNN fails rather than skips.
func cudnnBackend(t *testing.T, opt Options) (*Backend, *benchLog) {
	t.Helper()
	if !onGPU() {
		useEmu(t)
	}
	logs := &benchLog{}
	opt.KernelCache, opt.Attention, opt.Logf = kernelCacheForTests(t), "cudnn", logs.logf
	b, err := Open(opt)
	if err != nil {
		t.Fatalf("opening the backend with cuDNN attention: %v", err)
	}
	t.Cleanup(func() { b.Close() })
	return b, logs
}

// TestCudnnAttentionConformance: cuDNN's fused attention, forward and
// backward, against compute/cpu on packed samples of ragged lengths (one
// token, tile edges, a bucket of samples only partly used), GQA and MHA,
// head_dim 64, 80 and 128; the backward's gradients accumulate (+=) and a
// second run repeats the first bit for bit (the deterministic graph).
func TestCudnnAttentionConformance(t *testing.T) {
	be, logs := cudnnBackend(t, Options{})
	r := rand.New(rand.NewPCG(71, 72))
	lens := []int{1, 5, 16, 17, 63, 64, 65, 129, 2}
	if onGPU() {
		lens = []int{1, 5, 16, 17, 63, 64, 65, 128, 129, 300, 1000, 2}
	}
	for _, c := range []struct{ nHead, nKV, hd int }{{4, 2, 128}, {4, 1, 64}, {2, 2, 64}, {3, 3, 80}} {
		t.Run(fmt.Sprintf("h%d_kv%d_hd%d", c.nHead, c.nKV, c.hd), func(t *testing.T) {
			checkCudnnAttention(t, be, logs, newAttnCase(r, lens, c.nHead, c.nKV, c.hd))
		})
	}
	for _, p := range be.CudnnPlans() {
		t.Logf("plan: %s", p)
	}
}

// checkCudnnAttention runs ac's forward and backward on be, checks that
// cuDNN ran each, holds them to compute/cpu's on BF16-rounded inputs, and
// runs the backward again for the same bits. It returns the forward's
// output and the gradients.
func checkCudnnAttention(t *testing.T, be *Backend, logs *benchLog, ac *attnCase) (out, dq, dk, dv []float32) {
	t.Helper()
	r := rand.New(rand.NewPCG(uint64(ac.tokens), 77))
	calls := be.dnn.calls
	got, gotL := ac.run(be, ac.q, ac.k, ac.v)
	if be.dnn.calls[0] != calls[0]+1 {
		t.Fatalf("the forward did not run on cuDNN (log: %q)", logs.about("refused"))
	}
	qr, _ := roundBF16(ac.q)
	kr, _ := roundBF16(ac.k)
	vr, _ := roundBF16(ac.v)
	want, wantL := ac.run(oracle, qr, kr, vr)
	// cuDNN rounds P to BF16 before P·V and its output to BF16.
	closeTo(t, "cudnn attention vs cpu(bf16 q,k,v)", got, want, 1e-2, 2e-2)
	closeTo(t, "cudnn attention lse vs cpu(bf16 q,k)", gotL, wantL, 1e-4, 1e-5)

	dout := randF32(r, ac.tokens*ac.nHead*ac.hd)
	dq0, dk0, dv0 := randF32(r, len(ac.q)), randF32(r, len(ac.k)), randF32(r, len(ac.v))
	scale := float32(1 / math.Sqrt(float64(ac.hd)))
	run := func(be compute.Backend, q, k, v, o, lse, dout []float32) (dq, dk, dv []float32) {
		gq, gk, gv := be.FromF32(dq0), be.FromF32(dk0), be.FromF32(dv0)
		be.AttentionBackward(gq, gk, gv, be.FromF32(dout), be.FromF32(q), be.FromF32(k), be.FromF32(v), be.FromF32(o), be.FromF32(lse),
			be.FromI32(ac.starts), len(ac.lens), ac.maxLen, ac.tokens, ac.nHead, ac.nKV, ac.hd, scale)
		return readF32(be, gq, len(q)), readF32(be, gk, len(k)), readF32(be, gv, len(v))
	}
	dr, _ := roundBF16(dout)
	or, _ := roundBF16(got)
	calls = be.dnn.calls
	gq, gk, gv := run(be, ac.q, ac.k, ac.v, got, gotL, dout)
	if be.dnn.calls[1] != calls[1]+1 {
		t.Fatalf("the backward did not run on cuDNN (log: %q)", logs.about("refused"))
	}
	wq, wk, wv := run(oracle, qr, kr, vr, or, gotL, dr)
	// BF16 operands and P, dS; BF16 gradients added to F32 ones.
	atol, rtol := 2e-2*math.Sqrt(float64(ac.maxLen)/65), 2e-2
	closeTo(t, "cudnn attention dq", gq, wq, atol, rtol)
	closeTo(t, "cudnn attention dk", gk, wk, atol, rtol)
	closeTo(t, "cudnn attention dv", gv, wv, atol, rtol)
	gq2, gk2, gv2 := run(be, ac.q, ac.k, ac.v, got, gotL, dout)
	same(t, "cudnn attention dq", gq, gq2)
	same(t, "cudnn attention dk", gk, gk2)
	same(t, "cudnn attention dv", gv, gv2)
	return got, gq, gk, gv
}

// TestCudnnFixedLengths: a call whose samples all have one length and
// fill their bucket (one sample of 128 tokens; four of 64) runs cuDNN's
// graph without ragged offsets, lengths or padding mask ("fixed lengths"),
// conforms to compute/cpu forward and backward as the ragged graph does,
// and gives what the ragged graph gives (Options.AttnRaggedOnly). Calls
// that do not fill a bucket (one sample of 129 tokens; three of 64; one
// sample shorter) keep the ragged graph. Where cuDNN refuses the fixed
// graph, the call runs through the ragged one (not the own kernels),
// saying so once.
func TestCudnnFixedLengths(t *testing.T) {
	cases := []struct {
		lens           []int
		nHead, nKV, hd int
		wantPlan       string
	}{
		{[]int{128}, 4, 2, 128, "1 samples of 128 tokens each (fixed lengths)"},
		{[]int{64, 64, 64, 64}, 2, 2, 64, "4 samples of 64 tokens each (fixed lengths)"},
		{[]int{129}, 4, 2, 128, "1 samples of up to 256 tokens"},
		{[]int{64, 64, 64}, 2, 2, 64, "4 samples of up to 64 tokens"},
		{[]int{64, 63, 64, 64}, 4, 1, 64, "4 samples of up to 64 tokens"},
	}
	fixed, logs := cudnnBackend(t, Options{})
	ragged, rlogs := cudnnBackend(t, Options{AttnRaggedOnly: true})
	for _, c := range cases {
		t.Run(fmt.Sprint(c.lens), func(t *testing.T) {
			ac := newAttnCase(rand.New(rand.NewPCG(81, 82)), c.lens, c.nHead, c.nKV, c.hd)
			out, dq, dk, dv := checkCudnnAttention(t, fixed, logs, ac)
			plans := strings.Join(fixed.CudnnPlans(), "\n")
			for _, dir := range []string{"forward, ", "deterministic backward, "} {
				if !strings.Contains(plans, dir+c.wantPlan) {
					t.Errorf("no plan for the %s%s:\n%s", dir, c.wantPlan, plans)
				}
			}
			rout, rq, rk, rv := checkCudnnAttention(t, ragged, rlogs, ac)
			if rp := strings.Join(ragged.CudnnPlans(), "\n"); strings.Contains(rp, "fixed") {
				t.Errorf("AttnRaggedOnly built fixed plans:\n%s", rp)
			}
			closeTo(t, "fixed vs ragged graph: out", out, rout, 1e-2, 2e-2)
			atol := 2e-2 * math.Sqrt(float64(ac.maxLen)/65)
			closeTo(t, "fixed vs ragged graph: dq", dq, rq, atol, 2e-2)
			closeTo(t, "fixed vs ragged graph: dk", dk, rk, atol, 2e-2)
			closeTo(t, "fixed vs ragged graph: dv", dv, rv, atol, 2e-2)
		})
	}
	if plans := strings.Join(fixed.CudnnPlans(), "\n"); strings.Count(plans, "fixed lengths") != 4 {
		t.Errorf("want fixed plans for the forward and backward of two shapes only:\n%s", plans)
	}
	t.Run("refused", func(t *testing.T) {
		if onGPU() {
			t.Skip("the refusal is the emulator's switch")
		}
		t.Setenv("DISTILL_EMU_CUDNN_REFUSE_FIXED", "1")
		be, logs := cudnnBackend(t, Options{})
		ac := newAttnCase(rand.New(rand.NewPCG(83, 84)), []int{64, 64}, 2, 1, 64)
		checkCudnnAttention(t, be, logs, ac)
		plans := strings.Join(be.CudnnPlans(), "\n")
		if strings.Contains(plans, "fixed lengths") || !strings.Contains(plans, "2 samples of up to 64 tokens") {
			t.Errorf("plans after the fixed graph's refusal:\n%s", plans)
		}
		n := 0
		for _, l := range logs.lines {
			if strings.Contains(l, "refused") {
				n++
				if !strings.Contains(l, "runs through the ragged graph") {
					t.Errorf("refusal line %q", l)
				}
			}
		}
		if n != 2 { // the forward's and the backward's fixed plans
			t.Errorf("%d refusal lines, want 2: %q", n, logs.lines)
		}
	})
}

// TestCudnnPlanCache: calls whose sample count and longest sample fall in
// the same buckets reuse one plan; a new bucket builds one more, and the
// build is logged once per plan.
func TestCudnnPlanCache(t *testing.T) {
	be, logs := cudnnBackend(t, Options{})
	r := rand.New(rand.NewPCG(73, 74))
	for _, lens := range [][]int{{5, 7, 3}, {8, 1, 6}, {2, 8, 2, 2}, {1, 7}} { // 3-4 samples of 5-8 tokens at most, then 2
		ac := newAttnCase(r, lens, 2, 1, 64)
		ac.run(be, ac.q, ac.k, ac.v)
	}
	plans := be.CudnnPlans()
	if len(plans) != 2 {
		t.Fatalf("%d plans for two buckets: %q", len(plans), plans)
	}
	n := 0
	for _, l := range logs.lines {
		if strings.Contains(l, "attention plan for the forward") {
			n++
		}
	}
	if n != 2 {
		t.Fatalf("%d plan-build log lines, want 2: %q", n, logs.lines)
	}
}

// TestCudnnFallback: where cuDNN offers no engine for a shape, attention
// runs on the own kernels (still right), with one log line naming cuDNN
// and what it said; an explicit --attention cudnn without a usable cuDNN
// fails to open, naming the library and the version needed; auto falls
// back with a log line.
func TestCudnnFallback(t *testing.T) {
	if onGPU() {
		t.Skip("the fallback is exercised through the emulator's refusal switches")
	}
	t.Run("refused shape", func(t *testing.T) {
		t.Setenv("DISTILL_EMU_CUDNN_REFUSE", "1")
		be, logs := cudnnBackend(t, Options{})
		r := rand.New(rand.NewPCG(75, 76))
		ac := newAttnCase(r, []int{3, 9}, 2, 1, 64)
		got, _ := ac.run(be, ac.q, ac.k, ac.v)
		if be.dnn.calls[0] != 0 {
			t.Fatal("cuDNN ran although it offered no engine")
		}
		if l := logs.about("refused"); !strings.Contains(l, "own kernels") {
			t.Fatalf("no log line for the refusal: %q", logs.lines)
		}
		want, _ := ac.run(oracle, ac.q, ac.k, ac.v)
		closeTo(t, "fallback attention vs cpu", got, want, 4e-2, 4e-2)
		ac.run(be, ac.q, ac.k, ac.v)
		n := 0
		for _, l := range logs.lines {
			if strings.Contains(l, "refused") {
				n++
			}
		}
		if n != 1 {
			t.Fatalf("%d refusal log lines for one shape, want 1", n)
		}
	})
	t.Run("too old", func(t *testing.T) {
		useEmu(t)
		t.Setenv("DISTILL_EMU_CUDNN_VERSION", "90500")
		_, err := Open(Options{KernelCache: t.TempDir(), Attention: "cudnn"})
		if err == nil || !strings.Contains(err.Error(), "9.5.0") || !strings.Contains(err.Error(), "9.10.0") {
			t.Fatalf("Open with cuDNN 9.5 and attention cudnn: %v, want an error naming 9.5.0 and 9.10.0", err)
		}
		logs := &benchLog{}
		b, err := Open(Options{KernelCache: t.TempDir(), Logf: logs.logf})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		if b.dnn != nil || !strings.Contains(logs.about("attention runs on this package's kernels"), "9.5.0") {
			t.Fatalf("auto with cuDNN 9.5: dnn %v, log %q", b.dnn != nil, logs.lines)
		}
	})
	t.Run("missing", func(t *testing.T) {
		useEmu(t)
		t.Setenv("DISTILL_LIBCUDNN", "/nonexistent/libcudnn.so.9")
		_, err := Open(Options{KernelCache: t.TempDir(), Attention: "cudnn"})
		if err == nil || !strings.Contains(err.Error(), "cuDNN") || !strings.Contains(err.Error(), "DISTILL_LIBCUDNN") {
			t.Fatalf("Open without cuDNN and attention cudnn: %v, want an error naming cuDNN and DISTILL_LIBCUDNN", err)
		}
	})
}

// TestAttentionBackwardOverride: Options.AttentionBackward "mma" runs the
// backward on the own tensor-core kernels beside cuDNN's forward (from
// its lse and output), for head_dim 64 and 128, and leaves other head
// dims on cuDNN; the gradients conform to compute/cpu's.
func TestAttentionBackwardOverride(t *testing.T) {
	be, _ := cudnnBackend(t, Options{AttentionBackward: "mma"})
	r := rand.New(rand.NewPCG(73, 74))
	lens := []int{1, 17, 64, 129, 2}
	for _, c := range []struct{ nHead, nKV, hd int }{{4, 2, 128}, {4, 1, 64}, {3, 3, 80}} {
		t.Run(fmt.Sprintf("h%d_kv%d_hd%d", c.nHead, c.nKV, c.hd), func(t *testing.T) {
			ac := newAttnCase(r, lens, c.nHead, c.nKV, c.hd)
			got, gotL := ac.run(be, ac.q, ac.k, ac.v)
			dout := randF32(r, ac.tokens*c.nHead*c.hd)
			scale := float32(1 / math.Sqrt(float64(c.hd)))
			run := func(be compute.Backend, q, k, v, o, dout []float32) (dq, dk, dv []float32) {
				gq, gk, gv := be.New(compute.F32, len(q)), be.New(compute.F32, len(k)), be.New(compute.F32, len(v))
				be.AttentionBackward(gq, gk, gv, be.FromF32(dout), be.FromF32(q), be.FromF32(k), be.FromF32(v), be.FromF32(o), be.FromF32(gotL),
					be.FromI32(ac.starts), len(ac.lens), ac.maxLen, ac.tokens, c.nHead, c.nKV, c.hd, scale)
				return readF32(be, gq, len(q)), readF32(be, gk, len(k)), readF32(be, gv, len(v))
			}
			calls := be.dnn.calls
			gq, gk, gv := run(be, ac.q, ac.k, ac.v, got, dout)
			onCudnn := be.dnn.calls[1] != calls[1]
			if want := c.hd == 80; onCudnn != want {
				t.Fatalf("head_dim %d: the backward ran on cuDNN: %v, want %v", c.hd, onCudnn, want)
			}
			qr, _ := roundBF16(ac.q)
			kr, _ := roundBF16(ac.k)
			vr, _ := roundBF16(ac.v)
			dr, _ := roundBF16(dout)
			or, _ := roundBF16(got)
			wq, wk, wv := run(oracle, qr, kr, vr, or, dr)
			atol, rtol := 2e-2*math.Sqrt(float64(ac.maxLen)/65), 2e-2
			closeTo(t, "dq", gq, wq, atol, rtol)
			closeTo(t, "dk", gk, wk, atol, rtol)
			closeTo(t, "dv", gv, wv, atol, rtol)
		})
	}
}
