package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"distill/compute"
	"distill/train/loss"
)

// coefTap is a backend that keeps, as host values, the coefficients each
// LossHeadBackward is given (train/loss's pin test does the same). As a
// compute.Backend it has no LossHeadForwardKD: train/loss takes its host
// path through it.
type coefTap struct {
	compute.Backend
	coefs [][]float32
}

func (c *coefTap) LossHeadBackward(h *compute.LossHead, co *compute.LossCoef, dx, dw compute.Tensor) {
	for _, t := range []compute.Tensor{co.LseT, co.Lse1, co.A, co.CK} {
		if t != nil {
			c.coefs = append(c.coefs, readF32(c.Backend, t, t.Len()))
		}
	}
	c.coefs = append(c.coefs, []float32{co.WSFT})
	c.Backend.LossHeadBackward(h, co, dx, dw)
}

// coefTapDevice is coefTap with the backend's LossHeadForwardKD: train/loss
// takes its device path through it where it covers the configuration.
type coefTapDevice struct {
	*coefTap
	dev   compute.DeviceLossCoef
	calls int
}

func (c *coefTapDevice) LossHeadForwardKD(h *compute.LossHead, kd *compute.LossKD, co *compute.LossCoef) compute.LossValues {
	c.calls++
	return c.dev.LossHeadForwardKD(h, kd, co)
}

// coefBatch is a packed batch of N tokens over a vocabulary of V with a
// teacher top-k of K per token, normalized over V from random logits of
// scale spread; a few ranks get log-probs below exp's range (-800: their
// p is 0 in float64), and with K = V the teacher holds all the mass (no
// tail: the student's tail is exactly 0).
func coefBatch(r *rand.Rand, N, V, K int, spread float64) *loss.Targets {
	tg := &loss.Targets{Tokens: make([]int32, N), Starts: []int32{0, 7, 8, int32(N) - 9, int32(N)}, Mask: make([]uint8, N), K: K,
		TopIDs: make([]int32, N*K), TopLP: make([]float32, N*K)}
	for t := range tg.Tokens {
		tg.Tokens[t] = int32(r.IntN(V))
		if r.Float64() < 0.85 {
			tg.Mask[t] = 1
		}
	}
	lg := make([]float64, V)
	ord := make([]int, V)
	for t := 0; t < N; t++ {
		for v := range lg {
			lg[v], ord[v] = r.NormFloat64()*spread, v
		}
		slices.SortFunc(ord, func(a, b int) int { return -compareF(lg[a], lg[b]) })
		m := lg[ord[0]]
		var s float64
		for _, v := range lg {
			s += math.Exp(v - m)
		}
		for j := 0; j < K; j++ {
			tg.TopIDs[t*K+j] = int32(ord[j])
			tg.TopLP[t*K+j] = float32(lg[ord[j]] - m - math.Log(s))
		}
		if t%5 == 3 && K > 2 {
			tg.TopLP[t*K+K-1] = -800
		}
	}
	return tg
}

func compareF(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// TestLossCoefDevice: train/loss's device path (compute.DeviceLossCoef,
// k_loss_coef) gives pass 2 the coefficients of its host path bit for
// bit, and the same loss values and gradients, on random batches for
// every configuration it covers: fwd_kl under each tail mode, with and
// without T² scaling, SFT weight and a normalizer, temperatures at and
// away from 1 and the teacher's, K = V (no tail), extreme log-probs, and
// CE only (kd_weight 0). A configuration it does not cover (rev_kl)
// keeps the host path. The emulator here; the GPU in the suite, where
// NVRTC's contraction of a*b+c into an fma would show.
func TestLossCoefDevice(t *testing.T) {
	be := testBackend(t)
	type cfg struct {
		name string
		o    loss.Options
		K    int // 0: the batch's default
		norm float64
	}
	cases := []cfg{
		{"bucket", loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}, 0, 0},
		{"bucket_T1.5_t2", loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1.5, TeacherTemperature: 1.5, ScaleT2: true, KDWeight: 0.8, SFTWeight: 0.5}, 0, 37},
		{"bucket_nosft", loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1}, 0, 0},
		{"bucket_K=V", loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.2}, -1, 0},
		{"renormalize", loss.Options{KD: loss.FwdKL, Tail: loss.Renormalize, Temperature: 2, TeacherTemperature: 1, ScaleT2: true, KDWeight: 0.7, SFTWeight: 0.4}, 0, 0},
		{"renormalize_T1", loss.Options{KD: loss.FwdKL, Tail: loss.Renormalize, Temperature: 1, KDWeight: 1, SFTWeight: 0}, 0, 11},
		{"zero", loss.Options{KD: loss.FwdKL, Tail: loss.Zero, Temperature: 0.5, TeacherTemperature: 1.5, KDWeight: 1, SFTWeight: 0.3}, 0, 0},
		{"zero_K=V", loss.Options{KD: loss.FwdKL, Tail: loss.Zero, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}, -1, 0},
		{"sft_only", loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 0, SFTWeight: 1}, 0, 0},
	}
	const N, C, V = 40, 32, 96
	for ci, c := range cases {
		for _, spread := range []float64{1, 6} {
			t.Run(fmt.Sprintf("%s/spread%g", c.name, spread), func(t *testing.T) {
				r := rand.New(rand.NewPCG(uint64(ci), uint64(spread)))
				K := 16
				if c.K < 0 {
					K = V
				}
				tg := coefBatch(r, N, V, K, 2)
				x, w := randF32(r, N*C), randF32(r, V*C)
				for i := range x {
					x[i] *= float32(spread)
				}
				xt, wt := be.FromF32(x), be.FromF32(w)
				defer be.Free(xt)
				defer be.Free(wt)
				run := func(tap compute.Backend) (loss.Stats, []float32, []float32) {
					h := &loss.Head{Backend: tap, V: V, C: C, TileCols: 40}
					dx, dw := be.New(compute.F32, N*C), be.New(compute.F32, V*C)
					defer be.Free(dx)
					defer be.Free(dw)
					o := c.o
					st, err := h.ForwardBackward(xt, wt, dx, dw, tg, &o, c.norm)
					if err != nil {
						t.Fatal(err)
					}
					return st, readF32(be, dx, N*C), readF32(be, dw, V*C)
				}
				host := &coefTap{Backend: be}
				dev := &coefTapDevice{coefTap: &coefTap{Backend: be}, dev: be}
				hs, hdx, hdw := run(host)
				ds, ddx, ddw := run(dev)
				if dev.calls != 1 {
					t.Fatalf("the device path ran %d times, want 1: train/loss did not use LossHeadForwardKD", dev.calls)
				}
				if !sameBits64(hs.Loss, ds.Loss) || !sameBits64(hs.KD, ds.KD) || !sameBits64(hs.CE, ds.CE) || hs.Tokens != ds.Tokens {
					t.Fatalf("stats: device %+v, host %+v", ds, hs)
				}
				names := []string{"LseT", "Lse1", "A", "CK", "WSFT"}
				if len(host.coefs) != len(dev.coefs) {
					t.Fatalf("%d coefficient tensors on the device path, %d on the host's", len(dev.coefs), len(host.coefs))
				}
				if c.o.KDWeight == 0 {
					names = []string{"LseT", "Lse1", "A", "WSFT"}
				}
				for i := range host.coefs {
					if j := firstDiff32(dev.coefs[i], host.coefs[i]); j >= 0 {
						t.Fatalf("%s[%d]: device %v (%#x), host %v (%#x)", names[i], j, dev.coefs[i][j], math.Float32bits(dev.coefs[i][j]),
							host.coefs[i][j], math.Float32bits(host.coefs[i][j]))
					}
				}
				if j := firstDiff32(ddx, hdx); j >= 0 {
					t.Fatalf("dx[%d]: device path %v, host path %v", j, ddx[j], hdx[j])
				}
				if j := firstDiff32(ddw, hdw); j >= 0 {
					t.Fatalf("dw[%d]: device path %v, host path %v", j, ddw[j], hdw[j])
				}
				t.Logf("%d positions: loss %.6g (KD %.6g, CE %.6g), %d coefficient tensors equal bit for bit", ds.Tokens, ds.Loss, ds.KD, ds.CE, len(dev.coefs))
			})
		}
	}
	t.Run("rev_kl_keeps_host", func(t *testing.T) {
		r := rand.New(rand.NewPCG(99, 1))
		tg := coefBatch(r, N, V, 16, 2)
		xt, wt := be.FromF32(randF32(r, N*C)), be.FromF32(randF32(r, V*C))
		dx, dw := be.New(compute.F32, N*C), be.New(compute.F32, V*C)
		defer func() {
			for _, x := range []compute.Tensor{xt, wt, dx, dw} {
				be.Free(x)
			}
		}()
		dev := &coefTapDevice{coefTap: &coefTap{Backend: be}, dev: be}
		o := loss.Options{KD: loss.RevKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
		if _, err := (&loss.Head{Backend: dev, V: V, C: C}).ForwardBackward(xt, wt, dx, dw, tg, &o, 0); err != nil {
			t.Fatal(err)
		}
		if dev.calls != 0 || len(dev.coefs) == 0 {
			t.Fatalf("rev_kl: LossHeadForwardKD ran %d times, pass 2 %d tensors: want the host path", dev.calls, len(dev.coefs))
		}
	})
}

func sameBits64(a, b float64) bool { return math.Float64bits(a) == math.Float64bits(b) }

// firstDiff32 is the first index where a and b differ in their bits, or -1.
func firstDiff32(a, b []float32) int {
	if len(a) != len(b) {
		return 0
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return i
		}
	}
	return -1
}

// hostCoefs hides the backend's LossHeadForwardKD: train/loss computes
// pass 2's coefficients on the host through it (as before issue 23).
type hostCoefs struct{ compute.Backend }

// BenchmarkLossHeadCoef times the fused loss head's training call
// (train/loss's Head.ForwardBackward: pass 1, the coefficients, pass 2)
// at the Qwen3-0.6B shape (8192 counted positions, hidden 1024, vocab
// 151936, k = 64, fwd_kl bucket + 0.1 CE), with the coefficients on the
// host (download, float64 math, upload: the device waits) and on the
// device (k_loss_coef, no wait), on the same GPU in the same run. It
// reports each call's milliseconds and, from one profiled call, the
// milliseconds the GPU spent idle between the call's kernels (ProfileSpan
// less the kernels' sum: the round trip the device path removes). It
// needs a GPU; DISTILL_TRAIN_BENCH_DRYRUN=1 runs its code on the emulator
// at a tiny shape.
func BenchmarkLossHeadCoef(b *testing.B) {
	M, C, V, K := 8192, 1024, 151936, 64
	var be *Backend
	switch {
	case onGPU():
		be = benchBackend(b, false)
	case os.Getenv("DISTILL_TRAIN_BENCH_DRYRUN") == "1":
		be = testBackend(b)
		M, C, V, K = 64, 32, 500, 16
	default:
		b.Skip("benchmarks need a GPU: set DISTILL_CUDA_TEST=gpu (scripts/gpu-suite.sh); DISTILL_TRAIN_BENCH_DRYRUN=1 runs this one's code on the emulator")
	}
	r := rand.New(rand.NewPCG(5, 6))
	tg := &loss.Targets{Tokens: make([]int32, M+1), Starts: []int32{0, int32(M + 1)}, Mask: make([]uint8, M+1), K: K,
		TopIDs: make([]int32, (M+1)*K), TopLP: make([]float32, (M+1)*K)}
	for t := range tg.Tokens {
		tg.Tokens[t], tg.Mask[t] = int32(r.IntN(V)), 1
		perm := r.Perm(V)[:K] // distinct ids; log-probs of a top-k holding ~90% of the mass
		for j := range perm {
			tg.TopIDs[t*K+j], tg.TopLP[t*K+j] = int32(perm[j]), float32(math.Log(0.9/float64(K)))
		}
	}
	wt, err := be.Weight(randBF16(r, V*C, 0.02))
	if err != nil {
		b.Fatal(err)
	}
	xt := be.FromF32(randF32(r, (M+1)*C))
	dx, dw := be.New(compute.F32, (M+1)*C), be.New(compute.F32, V*C)
	defer func() {
		for _, t := range []compute.Tensor{wt, xt, dx, dw} {
			be.Free(t)
		}
	}()
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	for _, c := range []struct {
		name string
		tap  compute.Backend
	}{{"host", hostCoefs{be}}, {"device", be}} {
		b.Run(fmt.Sprintf("%s/M%d_C%d_V%d_k%d", c.name, M, C, V, K), func(b *testing.B) {
			h := &loss.Head{Backend: c.tap, V: V, C: C}
			call := func() {
				if _, err := h.ForwardBackward(xt, wt, dx, dw, tg, &opt, 0); err != nil {
					b.Fatal(err)
				}
				be.wait()
			}
			call() // warm up: plans, the memory pool
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				call()
			}
			b.StopTimer()
			b.ReportMetric(1e3*b.Elapsed().Seconds()/float64(b.N), "ms/call")
			be.SetProfile(true)
			call()
			var sum time.Duration
			for _, e := range be.Profile() {
				sum += e.Time
			}
			span := be.ProfileSpan()
			be.SetProfile(false)
			b.ReportMetric(1e3*sum.Seconds(), "kernel_ms")
			b.ReportMetric(1e3*(span-sum).Seconds(), "gpu_idle_ms")
		})
	}
}

// TestLossCoefDeviceExpLog: the device's exp64 and log64 (k_exp_log64)
// are compute.Exp and compute.Log bit for bit, over the loss math's
// ranges and both functions' edges (overflow, subnormal results, zeros,
// infinities, NaN). The coefficients round to fp32, which hides most
// differences of a float64 ulp; this holds the functions themselves.
func TestLossCoefDeviceExpLog(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(17, 18))
	xs := []float64{0, math.Copysign(0, -1), 1, -1, 0.5, 709.78, 709.782712893384, 709.79, -708.4, -720, -744.4, -745.13, -745.2, -1e10, -1e300,
		math.MaxFloat64, -math.MaxFloat64, 1e-300, 5e-324, math.Inf(1), math.Inf(-1), math.NaN(), 1e-30, math.Nextafter(1, 0), math.Nextafter(1, 2),
		7.07106781186547524401e-01, 2 * 7.07106781186547524401e-01}
	for i := 0; i < 20000; i++ {
		switch i % 3 {
		case 0:
			xs = append(xs, (r.Float64()*2-1)*30)
		case 1:
			xs = append(xs, -r.Float64()*760)
		default:
			xs = append(xs, math.Exp((r.Float64()*2-1)*700))
		}
	}
	n := len(xs)
	got := make([]float64, 2*n)
	func() {
		defer be.enter()()
		x, out := be.alloc(int64(n)*8), be.alloc(int64(2*n)*8)
		be.upload(x, unsafePtr(xs), int64(n)*8)
		be.ew("k_exp_log64", int64(n), dptr(out), dptr(x), int64(n))
		be.download(unsafePtr(got), out, int64(2*n)*8)
		be.free(x)
		be.free(out)
	}()
	same := func(a, b float64) bool {
		return math.Float64bits(a) == math.Float64bits(b) || math.IsNaN(a) && math.IsNaN(b)
	}
	for i, x := range xs {
		if e := compute.Exp(x); !same(got[i], e) {
			t.Fatalf("exp64(%v) = %v (%#x), compute.Exp %v (%#x)", x, got[i], math.Float64bits(got[i]), e, math.Float64bits(e))
		}
		if l := compute.Log(x); !same(got[n+i], l) {
			t.Fatalf("log64(%v) = %v (%#x), compute.Log %v (%#x)", x, got[n+i], math.Float64bits(got[n+i]), l, math.Float64bits(l))
		}
	}
	t.Logf("%d arguments: exp64 and log64 equal compute.Exp and compute.Log bit for bit", n)
}

// TestLossHeadKeepLogits: with compute.LossHead.Keep (loss.Head's
// KeepLogits), pass 2 reads the logits pass 1 kept instead of computing
// them again: the same loss values, coefficients, dx and dw bit for bit,
// on the device path (LossHeadForwardKD) and the host path
// (LossHeadForward), with one logit GEMM of three a tile fewer in pass
// 2, the kept logits (4·N·V bytes) in the peak, and nothing left
// allocated after. Options.RecomputeLogits keeps nothing. Kept logits no
// pass 2 read are freed by the next loss-head call.
func TestLossHeadKeepLogits(t *testing.T) {
	const N, C, V, tile = 40, 32, 96, 40 // three tiles: 40, 40, 16
	r := rand.New(rand.NewPCG(5, 6))
	tg := coefBatch(r, N, V, 16, 2)
	x, w := randF32(r, N*C), randF32(r, V*C)
	o := loss.Options{KD: loss.FwdKL, Tail: loss.Renormalize, Temperature: 1.5, TeacherTemperature: 1, KDWeight: 1, SFTWeight: 0.2}
	type result struct {
		st      loss.Stats
		dx, dw  []float32
		gemms   int   // pass 2's logit and gradient GEMMs
		peak    int64 // the pool's high-water mark over the call
		freeGap int64 // MemInfo's free before the call less after it
	}
	run := func(be *Backend, device, keep bool) result {
		var tap compute.Backend = &coefTap{Backend: be}
		if device {
			tap = &coefTapDevice{coefTap: &coefTap{Backend: be}, dev: be}
		}
		xt, wt := be.FromF32(x), be.FromF32(w)
		dx, dw := be.New(compute.F32, N*C), be.New(compute.F32, V*C)
		defer func() {
			for _, t := range []compute.Tensor{xt, wt, dx, dw} {
				be.Free(t)
			}
		}()
		h := &loss.Head{Backend: tap, V: V, C: C, TileCols: tile, KeepLogits: keep}
		oo := o
		free0, _ := be.MemInfo()
		be.ResetPeakMemory()
		base := be.PeakMemory()
		be.SetProfile(true)
		st, err := h.ForwardBackward(xt, wt, dx, dw, tg, &oo, 0)
		if err != nil {
			t.Fatal(err)
		}
		res := result{st: st, dx: readF32(be, dx, N*C), dw: readF32(be, dw, V*C), peak: be.PeakMemory() - base}
		for _, e := range be.Profile() {
			if e.Name == "cublasLt GEMM (LossHeadBackward)" {
				res.gemms = e.Calls
			}
		}
		be.SetProfile(false)
		free1, _ := be.MemInfo()
		res.freeGap = free0 - free1
		return res
	}
	be := testBackend(t)
	recompute, err := Open(Options{KernelCache: kernelCacheForTests(t), RecomputeLogits: true})
	if err != nil {
		t.Fatal(err)
	}
	defer recompute.Close()
	for _, device := range []bool{true, false} {
		t.Run(fmt.Sprintf("device=%v", device), func(t *testing.T) {
			off, on, forced := run(be, device, false), run(be, device, true), run(recompute, device, true)
			for _, c := range []struct {
				name string
				got  result
			}{{"kept", on}, {"RecomputeLogits", forced}} {
				if !sameBits64(c.got.st.Loss, off.st.Loss) || !sameBits64(c.got.st.KD, off.st.KD) || !sameBits64(c.got.st.CE, off.st.CE) {
					t.Errorf("%s: stats %+v, recomputed %+v", c.name, c.got.st, off.st)
				}
				if j := firstDiff32(c.got.dx, off.dx); j >= 0 {
					t.Errorf("%s: dx[%d] %v, recomputed %v", c.name, j, c.got.dx[j], off.dx[j])
				}
				if j := firstDiff32(c.got.dw, off.dw); j >= 0 {
					t.Errorf("%s: dw[%d] %v, recomputed %v", c.name, j, c.got.dw[j], off.dw[j])
				}
				if c.got.freeGap != 0 {
					t.Errorf("%s: %d bytes of device memory still held after the call", c.name, c.got.freeGap)
				}
			}
			if off.gemms != 9 || forced.gemms != 9 || on.gemms != 6 {
				t.Errorf("pass 2's GEMMs over 3 tiles: %d recomputing, %d under RecomputeLogits, %d keeping; want 9, 9, 6", off.gemms, forced.gemms, on.gemms)
			}
			// The kept logits hold the other tiles' 4·N·(V-tile) bytes
			// more (less what the pool's rounding of the sizes hides).
			if on.peak < off.peak+2*N*(V-tile) {
				t.Errorf("peak %d bytes keeping the logits, %d recomputing them: want about the %d bytes of the other tiles more", on.peak, off.peak, 4*N*(V-tile))
			}
			t.Logf("peak %d bytes recomputing, %d keeping; pass 2's GEMMs %d and %d", off.peak, on.peak, off.gemms, on.gemms)
		})
	}
	t.Run("unread", func(t *testing.T) {
		xt, wt := be.FromF32(x), be.FromF32(w)
		defer be.Free(xt)
		defer be.Free(wt)
		rows := make([]int32, N)
		for i := range rows {
			rows[i] = int32(i)
		}
		rt, lt := be.FromI32(rows), be.FromI32(make([]int32, N))
		defer be.Free(rt)
		defer be.Free(lt)
		free0, _ := be.MemInfo()
		h := &compute.LossHead{X: xt, W: wt, Rows: rt, Labels: lt, M: N, C: C, V: V, InvT: 1, TileCols: tile, Keep: true}
		be.LossHeadForward(h)
		if free1, _ := be.MemInfo(); free0-free1 < 4*N*V {
			t.Fatalf("no logits kept after a pass 1 with Keep: %d bytes held", free0-free1)
		}
		h2 := *h
		h2.Keep = false
		be.LossHeadForward(&h2) // a pass 1 of another call frees them
		if free2, _ := be.MemInfo(); free2 != free0 {
			t.Fatalf("%d bytes held after the next loss-head call", free0-free2)
		}
	})
}

// TestLossHeadKeepsWeightCopy: a LossHead's W that is no parameter (no
// BF16 shadow: a sharded student's gathered LM head) is rounded to BF16
// once for LossHeadForwardKD's pass 1 and its LossHeadBackward (a
// keptWeight), not once a pass: one k_f32_to_bf16 pass for the two, and
// nothing held after. A write to W between them (the backend sees it)
// makes pass 2 round W again: its dx and dw are those of a pass 2 over
// another tensor holding the new values, bit for bit.
func TestLossHeadKeepsWeightCopy(t *testing.T) {
	const N, C, V, tile = 40, 32, 96, 40
	be := testBackend(t)
	r := rand.New(rand.NewPCG(7, 8))
	x, w, w2 := randF32(r, N*C), randF32(r, V*C), randF32(r, V*C)
	rows, labels := make([]int32, N), make([]int32, N)
	for i := range rows {
		rows[i], labels[i] = int32(i), int32(r.IntN(V))
	}
	xt, rt, lt := be.FromF32(x), be.FromI32(rows), be.FromI32(labels)
	defer be.Free(xt)
	defer be.Free(rt)
	defer be.Free(lt)
	coef := &compute.LossCoef{LseT: be.New(compute.F32, N), Lse1: be.New(compute.F32, N), A: be.New(compute.F32, N), WSFT: 0.5}
	defer be.Free(coef.LseT)
	defer be.Free(coef.Lse1)
	defer be.Free(coef.A)
	// pass runs pass 1 over W = wt and pass 2 over W = wt2 (the same
	// tensor, or wt rewritten with w2 in between when write), counting
	// the rounding passes; it returns pass 2's dx and dw.
	pass := func(wt, wt2 compute.Tensor, write bool) (dx, dw []float32, rounds int) {
		dxt, dwt := be.New(compute.F32, N*C), be.New(compute.F32, V*C)
		defer be.Free(dxt)
		defer be.Free(dwt)
		h := &compute.LossHead{X: xt, W: wt, Rows: rt, Labels: lt, M: N, C: C, V: V, InvT: 1, TileCols: tile}
		free0, _ := be.MemInfo()
		be.SetProfile(true)
		v := be.LossHeadForwardKD(h, nil, coef)
		if write {
			be.WriteF32(wt, w2)
		}
		h2 := h
		if wt2 != wt {
			c := *h
			c.W, h2 = wt2, &c
		}
		be.LossHeadBackward(h2, coef, dxt, dwt)
		v.Read(make([]float64, N), make([]float64, N))
		for _, e := range be.Profile() {
			if strings.HasPrefix(e.Name, "k_f32_to_bf16") {
				rounds += e.Calls
			}
		}
		be.SetProfile(false)
		if free1, _ := be.MemInfo(); free1 != free0 {
			t.Fatalf("%d bytes held after pass 2", free0-free1)
		}
		return readF32(be, dxt, N*C), readF32(be, dwt, V*C), rounds
	}
	wt, wt2 := be.FromF32(w), be.FromF32(w2)
	defer be.Free(wt)
	defer be.Free(wt2)
	if _, _, n := pass(wt, wt, false); n != 1 {
		t.Errorf("pass 1 and pass 2 over one W rounded it %d times, want once", n)
	}
	wantDx, wantDw, _ := pass(wt, wt2, false)
	be.WriteF32(wt, w)
	dx, dw, n := pass(wt, wt, true)
	if n != 2 {
		t.Errorf("W written between pass 1 and pass 2: %d roundings, want 2", n)
	}
	if j := firstDiff32(dx, wantDx); j >= 0 {
		t.Errorf("W written between the passes: dx[%d] %v, want %v (pass 2 over the new W)", j, dx[j], wantDx[j])
	}
	if j := firstDiff32(dw, wantDw); j >= 0 {
		t.Errorf("W written between the passes: dw[%d] %v, want %v", j, dw[j], wantDw[j])
	}
}
