package loss

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"sort"
	"strings"
	"testing"

	cref "distill/compute/ref"
)

// sampledRow draws a position's sampled target from p: N draws by inverse
// CDF with rng's uniforms, tallied, as ids with log r (the head's exact
// log p first under head+sampled). It is an independent restatement of
// what the cache stores, in float64.
func sampledRow(rng *rand.Rand, p []float64, kind TargetKind, k, N int) ([]int32, []float64) {
	V := len(p)
	var ids []int32
	var lr []float64
	in := make([]bool, V)
	tail := 1.0
	if kind == HeadSampled {
		ord := make([]int, V)
		for v := range ord {
			ord[v] = v
		}
		sort.Slice(ord, func(a, b int) bool { return p[ord[a]] > p[ord[b]] })
		for _, v := range ord[:k] {
			ids, lr = append(ids, int32(v)), append(lr, math.Log(p[v]))
			in[v] = true
			tail -= p[v]
		}
	}
	count := map[int32]int{}
	for d := 0; d < N; d++ {
		x, cum := rng.Float64()*tail, 0.0
		pick := int32(-1)
		for v := 0; v < V; v++ {
			if in[v] {
				continue
			}
			cum += p[v]
			pick = int32(v)
			if cum > x {
				break
			}
		}
		count[pick]++
	}
	var drawn []int32
	for v := range count {
		drawn = append(drawn, v)
	}
	sort.Slice(drawn, func(a, b int) bool { return drawn[a] < drawn[b] })
	for _, v := range drawn {
		ids, lr = append(ids, v), append(lr, math.Log(tail*float64(count[v])/float64(N)))
	}
	return ids, lr
}

// padRows packs variable-length rows into (n, K) with K the widest row,
// padding with the lowest ids not in the row at r = 0 (log r = -Inf).
func padRows(rows [][]int32, lrs [][]float64, V int) (int, []int32, []float32) {
	K := 0
	for _, r := range rows {
		K = max(K, len(r))
	}
	ids, lps := make([]int32, len(rows)*K), make([]float32, len(rows)*K)
	for t, r := range rows {
		in := map[int32]bool{}
		for j, id := range r {
			ids[t*K+j], lps[t*K+j] = id, float32(lrs[t][j])
			in[id] = true
		}
		cand := int32(0)
		for j := len(r); j < K; j++ {
			for in[cand] {
				cand++
			}
			ids[t*K+j], lps[t*K+j] = cand, float32(math.Inf(-1))
			cand++
		}
	}
	return K, ids, lps
}

// sampledRef is the loss of the package doc's Sampled targets in float64:
// the mean over counted positions of Σ_e r_e (log r_e - lq_e) with lq the
// full-vocabulary log-softmax of z/T, plus the cross-entropy at T = 1.
func sampledRef(x, w []float64, C, V int, tg *Targets, o Options) (total, kd, ce float64) {
	M := 0
	for s := 0; s+1 < len(tg.Starts); s++ {
		for t := int(tg.Starts[s]); t+1 < int(tg.Starts[s+1]); t++ {
			if tg.Mask[t+1] == 0 {
				continue
			}
			M++
			z := make([]float64, V)
			for v := range z {
				for c := 0; c < C; c++ {
					z[v] += x[t*C+c] * w[v*C+c]
				}
			}
			lse := func(f float64) float64 {
				mx := math.Inf(-1)
				for _, v := range z {
					mx = math.Max(mx, v*f)
				}
				var s float64
				for _, v := range z {
					s += math.Exp(v*f - mx)
				}
				return mx + math.Log(s)
			}
			lseT, lse1 := lse(1/o.Temperature), lse(1)
			ce += lse1 - z[tg.Tokens[t+1]]
			for j := 0; j < tg.K; j++ {
				lr := float64(tg.TopLP[t*tg.K+j])
				if math.IsInf(lr, -1) {
					continue
				}
				kd += math.Exp(lr) * (lr - (z[tg.TopIDs[t*tg.K+j]]/o.Temperature - lseT))
			}
		}
	}
	kd, ce = kd/float64(M), ce/float64(M)
	wkd := o.KDWeight
	if o.ScaleT2 {
		wkd *= o.Temperature * o.Temperature
	}
	return wkd*kd + o.SFTWeight*ce, kd, ce
}

func sampledBatch(seed int64, C, V int, kind TargetKind, k, N int) *batch {
	b := newBatch(seed, C, V, 1)
	rng := rand.New(rand.NewSource(seed + 7))
	var rows [][]int32
	var lrs [][]float64
	for t := 0; t < b.N; t++ {
		p := make([]float64, V)
		var s float64
		for v := range p {
			p[v] = math.Exp(2 * rng.NormFloat64())
			s += p[v]
		}
		for v := range p {
			p[v] /= s
		}
		ids, lr := sampledRow(rng, p, kind, k, N)
		rows, lrs = append(rows, ids), append(lrs, lr)
	}
	b.K, b.tg.TopIDs, b.tg.TopLP = padRows(rows, lrs, V)
	b.tg.K = b.K
	return b
}

// TestSampledLossAndGradients checks the sampled targets' loss and
// gradient against the float64 reference above and its central finite
// differences, for both kinds, with and without SFT, at T = Tc = 1 and
// 1.5 with T², over a tile (7) that does not divide V.
func TestSampledLossAndGradients(t *testing.T) {
	for _, kind := range []TargetKind{Sampled, HeadSampled} {
		for _, c := range []struct {
			T       float64
			t2      bool
			kdw, sw float64
		}{{1, false, 1, 0}, {1, false, 0.6, 0.5}, {1.5, true, 1, 0.2}} {
			t.Run(fmt.Sprintf("%s/T=%g/kd=%g/sft=%g", kind, c.T, c.kdw, c.sw), func(t *testing.T) {
				C, V := 6, 50
				b := sampledBatch(5, C, V, kind, 3, 12)
				o := Options{Targets: kind, KD: FwdKL, Tail: Bucket, Temperature: c.T, TeacherTemperature: c.T,
					ScaleT2: c.t2, KDWeight: c.kdw, SFTWeight: c.sw}
				h := &Head{V: V, C: C, TileCols: 7}
				dx, dw := make([]float32, len(b.x)), make([]float32, len(b.w))
				st, err := h.fwdBwd(b.x, b.w, dx, dw, &b.tg, &o, 0)
				if err != nil {
					t.Fatal(err)
				}
				xd, wd := cref.F64(b.x), cref.F64(b.w)
				want, wkd, wce := sampledRef(xd, wd, C, V, &b.tg, o)
				closeRel(t, "loss", st.Loss, want, 1e-6, lossRtol)
				closeRel(t, "kd", st.KD, wkd, 1e-6, lossRtol)
				closeRel(t, "ce", st.CE, wce, 1e-6, lossRtol)
				f := func() float64 { l, _, _ := sampledRef(xd, wd, C, V, &b.tg, o); return l }
				gx, gw := cref.Grad(f, xd, nil, 1e-5), cref.Grad(f, wd, nil, 1e-5)
				for i := range gx {
					closeRel(t, fmt.Sprintf("dx[%d]", i), float64(dx[i]), gx[i], gradAtol, gradRtol)
				}
				for i := range gw {
					closeRel(t, fmt.Sprintf("dw[%d]", i), float64(dw[i]), gw[i], gradAtol, gradRtol)
				}
				// Several teachers of the same kind take the same path:
				// one teacher of weight 1 is the single-teacher loss.
				mt := b.tg
				mt.K, mt.TopIDs, mt.TopLP = 0, nil, nil
				mt.Teachers = []Teacher{{Weight: 1, K: b.K, TopIDs: b.tg.TopIDs, TopLP: b.tg.TopLP}}
				dx2, dw2 := make([]float32, len(b.x)), make([]float32, len(b.w))
				st2, err := (&Head{V: V, C: C, TileCols: 7}).fwdBwd(b.x, b.w, dx2, dw2, &mt, &o, 0)
				if err != nil {
					t.Fatal(err)
				}
				closeRel(t, "multi-teacher loss", st2.Loss, st.Loss, 1e-7, 1e-6)
				for i := range dw {
					closeRel(t, fmt.Sprintf("multi-teacher dw[%d]", i), float64(dw2[i]), float64(dw[i]), 1e-7, 1e-5)
				}
			})
		}
	}
}

// TestSampledOptimum: stochastic gradient descent on free logits (V = 64,
// one position), drawing fresh sampled targets (N = 16) at every step,
// converges to the teacher's p itself, tail included: the targets'
// gradient is unbiased, so its fixed point in expectation is q = p. The
// iterates are averaged over the second half (Polyak), with a 1/sqrt(step)
// rate. A top-k target (tail zero, the same bytes) converges elsewhere,
// which shows the check can fail.
func TestSampledOptimum(t *testing.T) {
	const V = 64
	rng := rand.New(rand.NewSource(9))
	p := make([]float64, V)
	var s float64
	for v := range p {
		p[v] = math.Exp(1.2 * rng.NormFloat64())
		s += p[v]
	}
	for v := range p {
		p[v] /= s
	}
	run := func(kind TargetKind, k int, tail Tail) (maxErr float64) {
		z := make([]float32, V)
		x, dx, dz := []float32{1, 1}, make([]float32, 2), make([]float32, V)
		avg := make([]float64, V)
		h := &Head{V: V, C: 1}
		o := Options{Targets: kind, KD: FwdKL, Tail: tail, Temperature: 1, KDWeight: 1}
		const steps = 20000
		drng := rand.New(rand.NewSource(10))
		for step := 0; step < steps; step++ {
			var ids []int32
			var lr []float64
			if kind == TopK {
				// The top-12 renormalized (tail zero): about the bytes of
				// 16 draws.
				ids, lr = sampledRow(drng, p, HeadSampled, 12, 1)
				ids, lr = ids[:12], lr[:12]
			} else {
				ids, lr = sampledRow(drng, p, kind, k, 16)
			}
			K, tid, tlp := padRows([][]int32{ids, ids}, [][]float64{lr, lr}, V)
			tg := Targets{Tokens: []int32{0, 1}, Starts: []int32{0, 2}, Mask: []uint8{0, 1}, K: K, TopIDs: tid, TopLP: tlp}
			clear(dz)
			if _, err := h.fwdBwd(x, z, dx, dz, &tg, &o, 0); err != nil {
				t.Fatal(err)
			}
			lrate := 2 / math.Sqrt(float64(step+1))
			for v := range z {
				z[v] -= float32(lrate * float64(dz[v]))
			}
			if step >= steps/2 {
				q := softmax64(z)
				for v := range avg {
					avg[v] += q[v] / (steps / 2)
				}
			}
		}
		for v := range p {
			maxErr = math.Max(maxErr, math.Abs(avg[v]-p[v]))
		}
		return maxErr
	}
	for _, c := range []struct {
		kind TargetKind
		k    int
	}{{Sampled, 0}, {HeadSampled, 4}} {
		e := run(c.kind, c.k, Bucket)
		t.Logf("%s: max |E[q] - p| = %.5f", c.kind, e)
		if e > 0.004 {
			t.Errorf("%s: the averaged student is %.4f from the teacher at some id, want <= 0.004", c.kind, e)
		}
	}
	if e := run(TopK, 0, Zero); e < 0.01 {
		t.Errorf("top-12 with tail zero ends %.4f from p: the test cannot tell a biased target", e)
	} else {
		t.Logf("topk (k 12, tail zero): max |E[q] - p| = %.4f (biased)", e)
	}
}

func softmax64(z []float32) []float64 {
	mx := math.Inf(-1)
	for _, v := range z {
		mx = math.Max(mx, float64(v))
	}
	q := make([]float64, len(z))
	var s float64
	for v := range z {
		q[v] = math.Exp(float64(z[v]) - mx)
		s += q[v]
	}
	for v := range q {
		q[v] /= s
	}
	return q
}

// TestSampledInvalid: what sampled targets cannot be is refused, naming
// the keys and why.
func TestSampledInvalid(t *testing.T) {
	base := Options{KD: FwdKL, Tail: Bucket, Temperature: 1, KDWeight: 1}
	for _, c := range []struct {
		edit func(o *Options)
		want string
	}{
		{func(o *Options) { o.Targets, o.KD = Sampled, RevKL }, "kd_loss rev_kl with targets sampled: only fwd_kl"},
		{func(o *Options) { o.Targets, o.KD, o.Beta = HeadSampled, JSD, 0.5 }, "kd_loss jsd with targets head+sampled"},
		{func(o *Options) { o.Targets, o.Temperature, o.TeacherTemperature = Sampled, 2, 1 }, "temperature 2 with targets sampled captured at 1"},
		{func(o *Options) { o.Targets, o.Tail = Sampled, Renormalize }, "tail renormalize with targets sampled"},
		{func(o *Options) { o.Targets = "gumbel" }, `targets "gumbel"`},
	} {
		o := base
		c.edit(&o)
		err := o.Validate()
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want ErrInvalid naming %q", o, err, c.want)
		}
	}
	// -Inf (a padding entry) is a sampled target's r = 0, never a top-k's.
	b := newBatch(3, 4, 20, 3)
	b.tg.TopLP[5] = float32(math.Inf(-1))
	if _, err := (&Head{V: 20, C: 4}).fwd(b.x, b.w, &b.tg, &base); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a top-k log-prob of -Inf: %v", err)
	}
}
