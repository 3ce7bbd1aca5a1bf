package loss

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"sort"
	"strings"
	"testing"

	"distill/train/internal/ref"
)

// Tolerances: losses vs the float64 reference at 1e-5 relative (+1e-6);
// gradients vs central finite differences of the reference (h = 1e-5) at
// |got-want| <= 2e-6 + 2e-3·|want| (fp32 logits, fast exp with 2 ulp).
const (
	lossRtol           = 1e-5
	gradAtol, gradRtol = 2e-6, 2e-3
)

type batch struct {
	N, C, V, K int
	x, w       []float32
	tg         Targets
}

// newBatch builds a packed batch of three samples with a partly masked
// loss, random student weights, and a teacher top-k taken from a random
// full distribution (so the stored log-probs are normalized over V).
func newBatch(seed int64, C, V, K int) *batch {
	rng := rand.New(rand.NewSource(seed))
	starts := []int32{0, 5, 6, 13}
	N := int(starts[3])
	b := &batch{N: N, C: C, V: V, K: K}
	b.x = make([]float32, N*C)
	for i := range b.x {
		b.x[i] = float32(rng.NormFloat64())
	}
	b.w = make([]float32, V*C)
	for i := range b.w {
		b.w[i] = float32(rng.NormFloat64() * 0.7)
	}
	tok := make([]int32, N)
	mask := make([]uint8, N)
	for t := range tok {
		tok[t] = int32(rng.Intn(V))
		if rng.Float64() < 0.75 {
			mask[t] = 1
		}
	}
	mask[1], mask[2] = 0, 1
	ids := make([]int32, N*K)
	lps := make([]float32, N*K)
	for t := 0; t < N; t++ {
		lg := make([]float64, V)
		for v := range lg {
			lg[v] = rng.NormFloat64() * 2
		}
		ord := make([]int, V)
		for v := range ord {
			ord[v] = v
		}
		sort.Slice(ord, func(a, b int) bool { return lg[ord[a]] > lg[ord[b]] })
		m := lg[ord[0]]
		var s float64
		for _, v := range lg {
			s += math.Exp(v - m)
		}
		for j := 0; j < K; j++ {
			ids[t*K+j] = int32(ord[j])
			lps[t*K+j] = float32(lg[ord[j]] - m - math.Log(s))
		}
	}
	b.tg = Targets{Tokens: tok, Starts: starts, Mask: mask, K: K, TopIDs: ids, TopLP: lps}
	return b
}

func (b *batch) refOpts(o Options) ref.KDOpts {
	tc := o.TeacherTemperature
	if tc == 0 {
		tc = 1
	}
	return ref.KDOpts{Kind: string(o.KD), Beta: o.Beta, Tail: string(o.Tail), T: o.Temperature, Tc: tc,
		ScaleT2: o.ScaleT2, KDWeight: o.KDWeight, SFTW: o.SFTWeight}
}

func closeRel(t *testing.T, name string, got, want, atol, rtol float64) {
	t.Helper()
	if d := math.Abs(got - want); !(d <= atol+rtol*math.Abs(want)) {
		t.Fatalf("%s = %.10g, want %.10g (|diff| %.3g)", name, got, want, d)
	}
}

// TestLossAndGradients checks every divergence x tail x temperature x SFT
// combination (tail zero with fwd_kl only, the others with every
// divergence) against the float64 reference and its finite differences,
// with a vocabulary tile (7) that does not divide V (50), so that teacher
// ids, labels and maxima fall in every tile position.
func TestLossAndGradients(t *testing.T) {
	type cfg struct {
		kd      Divergence
		beta    float64
		tail    Tail
		T, Tc   float64
		t2      bool
		kdw, sw float64
	}
	var cases []cfg
	for _, d := range []struct {
		kd   Divergence
		beta float64
	}{{FwdKL, 0}, {RevKL, 0}, {JSD, 0.3}, {JSD, 0}, {JSD, 1}} {
		cases = append(cases,
			cfg{d.kd, d.beta, Renormalize, 1, 1, false, 1, 0},
			cfg{d.kd, d.beta, Renormalize, 2, 1, true, 0.7, 0.4},
			cfg{d.kd, d.beta, Renormalize, 0.5, 1.5, false, 1, 0},
			cfg{d.kd, d.beta, Bucket, 1, 1, false, 1, 0.5},
			cfg{d.kd, d.beta, Bucket, 1.5, 1.5, true, 1, 0},
		)
	}
	cases = append(cases,
		cfg{FwdKL, 0, Zero, 1, 1, false, 1, 0},
		cfg{FwdKL, 0, Zero, 2, 1, true, 0.7, 0.4},
		cfg{FwdKL, 0, Zero, 0.5, 1.5, false, 1, 0},
		cfg{FwdKL, 0, Renormalize, 1, 1, false, 0, 1},
		cfg{FwdKL, 0, Zero, 1, 1, false, 0, 1},
		cfg{FwdKL, 0, Bucket, 3, 3, false, 0, 1})
	for _, c := range cases {
		name := fmt.Sprintf("%s(%g)/%s/T=%g/Tc=%g/t2=%v/kd=%g/sft=%g", c.kd, c.beta, c.tail, c.T, c.Tc, c.t2, c.kdw, c.sw)
		t.Run(name, func(t *testing.T) {
			C, V, K := 6, 50, 5
			b := newBatch(11, C, V, K)
			o := Options{KD: c.kd, Beta: c.beta, Tail: c.tail, Temperature: c.T, TeacherTemperature: c.Tc,
				ScaleT2: c.t2, KDWeight: c.kdw, SFTWeight: c.sw}
			h := &Head{V: V, C: C, TileCols: 7}
			dx, dw := make([]float32, len(b.x)), make([]float32, len(b.w))
			st, err := h.fwdBwd(b.x, b.w, dx, dw, &b.tg, &o, 0)
			if err != nil {
				t.Fatal(err)
			}
			xd, wd := ref.F64(b.x), ref.F64(b.w)
			ro := b.refOpts(o)
			f := func() float64 {
				l, _, _ := ref.KDLoss(xd, wd, C, V, b.tg.Tokens, b.tg.Starts, b.tg.Mask, K, b.tg.TopIDs, b.tg.TopLP, ro)
				return l
			}
			want, wkd, wce := ref.KDLoss(xd, wd, C, V, b.tg.Tokens, b.tg.Starts, b.tg.Mask, K, b.tg.TopIDs, b.tg.TopLP, ro)
			if c.kdw == 0 {
				wkd = 0
			}
			closeRel(t, "loss", st.Loss, want, 1e-6, lossRtol)
			closeRel(t, "kd", st.KD, wkd, 1e-6, lossRtol)
			closeRel(t, "ce", st.CE, wce, 1e-6, lossRtol)
			if want := countPositions(&b.tg); st.Tokens != want {
				t.Fatalf("counted %d positions, want %d", st.Tokens, want)
			}
			// The forward-only path must agree.
			st2, err := (&Head{V: V, C: C}).fwd(b.x, b.w, &b.tg, &o)
			if err != nil || math.Abs(st2.Loss-st.Loss) > 1e-6*math.Abs(st.Loss)+1e-7 {
				t.Fatalf("Forward = %v, %v; ForwardBackward gave %v", st2, err, st)
			}
			gx, gw := ref.Grad(f, xd, nil, 1e-5), ref.Grad(f, wd, nil, 1e-5)
			for i := range gx {
				closeRel(t, fmt.Sprintf("dx[%d]", i), float64(dx[i]), gx[i], gradAtol, gradRtol)
			}
			for i := range gw {
				closeRel(t, fmt.Sprintf("dw[%d]", i), float64(dw[i]), gw[i], gradAtol, gradRtol)
			}
		})
	}
}

// countPositions counts positions t with t+1 in the same sample and
// mask[t+1] = 1, straight from the definition.
func countPositions(tg *Targets) int {
	n := 0
	for s := 0; s+1 < len(tg.Starts); s++ {
		for t := tg.Starts[s]; t+1 < tg.Starts[s+1]; t++ {
			if tg.Mask[t+1] == 1 {
				n++
			}
		}
	}
	return n
}

func TestCountedPositions(t *testing.T) {
	b := newBatch(11, 4, 20, 3)
	want := countPositions(&b.tg)
	if want < 5 || want > 10 {
		t.Fatalf("newBatch counts %d positions; the test wants a partial mask", want)
	}
	o := Options{KD: FwdKL, Tail: Renormalize, Temperature: 1, KDWeight: 1}
	h := &Head{V: 20, C: 4}
	st, err := h.fwd(b.x, b.w, &b.tg, &o)
	if err != nil || st.Tokens != want {
		t.Fatalf("tokens %d err %v, want %d", st.Tokens, err, want)
	}
	// The last position of a sample predicts the next sample's first token:
	// its teacher row must not matter.
	last := int(b.tg.Starts[1]) - 1
	for j := 0; j < b.K; j++ {
		b.tg.TopLP[last*b.K+j] = -50
	}
	st2, _ := h.fwd(b.x, b.w, &b.tg, &o)
	if st2.Loss != st.Loss {
		t.Fatalf("loss changed from %v to %v with the teacher row of a sample's last token", st.Loss, st2.Loss)
	}
}

// TestExactKLWithFullVocab: with k = V every tail mode is the exact
// divergence between the teacher and the student over the whole
// vocabulary at temperature T, computed here directly from the teacher's
// full distribution (not through the reference package): fwd_kl, rev_kl
// and jsd under renormalize and bucket (at T = Tc), fwd_kl under zero.
func TestExactKLWithFullVocab(t *testing.T) {
	C, V := 8, 40
	b := newBatch(5, C, V, V)
	for _, d := range []struct {
		kd   Divergence
		beta float64
	}{{FwdKL, 0}, {RevKL, 0}, {JSD, 0.3}} {
		for _, tail := range []Tail{Renormalize, Zero, Bucket} {
			if tail == Zero && d.kd != FwdKL {
				continue
			}
			for _, T := range []float64{1, 2} {
				// The cache holds the teacher at Tc = 1; bucket needs T = Tc,
				// so it reads the same log-probs as captured at T.
				Tc := 1.0
				if tail == Bucket {
					Tc = T
				}
				o := Options{KD: d.kd, Beta: d.beta, Tail: tail, Temperature: T, TeacherTemperature: Tc, KDWeight: 1}
				st, err := (&Head{V: V, C: C, TileCols: 16}).fwd(b.x, b.w, &b.tg, &o)
				if err != nil {
					t.Fatal(err)
				}
				want := exactDivergence(b, d.kd, d.beta, T, Tc)
				closeRel(t, fmt.Sprintf("%s(%g)/%s/T=%g exact", d.kd, d.beta, tail, T), st.KD, want, 1e-7, 1e-5)
			}
		}
	}
}

// exactDivergence is the mean over counted positions of the divergence
// between the teacher tempered from Tc to T, p ∝ exp(lp·Tc/T) over all of
// the vocabulary (b.K = V), and the student softmax(z/T).
func exactDivergence(b *batch, kd Divergence, beta, T, Tc float64) float64 {
	C, V := b.C, b.V
	var sum float64
	n := 0
	for s := 0; s+1 < len(b.tg.Starts); s++ {
		for tt := int(b.tg.Starts[s]); tt+1 < int(b.tg.Starts[s+1]); tt++ {
			if b.tg.Mask[tt+1] == 0 {
				continue
			}
			n++
			p := make([]float64, V)
			var zp float64
			for j := 0; j < V; j++ {
				p[b.tg.TopIDs[tt*V+j]] = math.Exp(float64(b.tg.TopLP[tt*V+j]) * Tc / T)
				zp += p[b.tg.TopIDs[tt*V+j]]
			}
			q := make([]float64, V)
			var zq float64
			for v := 0; v < V; v++ {
				var z float64
				for i := 0; i < C; i++ {
					z += float64(b.x[tt*C+i]) * float64(b.w[v*C+i])
				}
				q[v] = math.Exp(z / T)
				zq += q[v]
			}
			for v := 0; v < V; v++ {
				pv, qv := p[v]/zp, q[v]/zq
				switch kd {
				case FwdKL:
					sum += pv * math.Log(pv/qv)
				case RevKL:
					sum += qv * math.Log(qv/pv)
				case JSD:
					m := beta*pv + (1-beta)*qv
					sum += beta*pv*math.Log(pv/m) + (1-beta)*qv*math.Log(qv/m)
				}
			}
		}
	}
	return sum / float64(n)
}

// TestTailPrecision: when the top-k holds all but 1e-9 of the student's
// mass, 1 - Σ_K q in fp32 is noise, but the bucket loss must still see
// the tail: compare with float64.
func TestTailPrecision(t *testing.T) {
	C, V, K := 1, 30, 2
	x := []float32{1, 1}
	w := make([]float32, V)
	for v := range w {
		w[v] = -20
	}
	w[3], w[7] = 3, 2.5
	// Teacher: put 1e-3 in the tail.
	lp := []float32{float32(math.Log(0.6)), float32(math.Log(0.399))}
	tg := Targets{Tokens: []int32{0, 3}, Starts: []int32{0, 2}, Mask: []uint8{0, 1}, K: K,
		TopIDs: []int32{3, 7, 3, 7}, TopLP: append(lp, lp...)}
	o := Options{KD: FwdKL, Tail: Bucket, Temperature: 1, KDWeight: 1}
	st, err := (&Head{V: V, C: C}).fwd(x, w, &tg, &o)
	if err != nil {
		t.Fatal(err)
	}
	z := func(v int) float64 { return float64(w[v]) }
	Z := math.Exp(z(3)) + math.Exp(z(7)) + float64(V-2)*math.Exp(-20)
	q3, q7, qt := math.Exp(z(3))/Z, math.Exp(z(7))/Z, float64(V-2)*math.Exp(-20)/Z
	p3, p7 := math.Exp(float64(lp[0])), math.Exp(float64(lp[1]))
	pt := 1 - p3 - p7
	want := p3*math.Log(p3/q3) + p7*math.Log(p7/q7) + pt*math.Log(pt/qt)
	closeRel(t, "kd", st.KD, want, 0, 1e-5)
}

func TestInvalid(t *testing.T) {
	b := newBatch(1, 4, 20, 3)
	good := Options{KD: FwdKL, Tail: Renormalize, Temperature: 1, KDWeight: 1}
	h := &Head{V: 20, C: 4}
	if b.tg.Mask[8] != 1 {
		t.Fatal("position 7 must be counted for this test")
	}
	for _, c := range []struct {
		name string
		edit func(o *Options, tg *Targets)
		want string
	}{
		{"kd", func(o *Options, _ *Targets) { o.KD = "kl" }, "kd_loss"},
		{"tail", func(o *Options, _ *Targets) { o.Tail = "" }, "want bucket, renormalize or zero"},
		{"zeroRev", func(o *Options, _ *Targets) { o.KD, o.Tail = RevKL, Zero }, "kd_loss rev_kl with tail zero"},
		{"zeroJSD", func(o *Options, _ *Targets) { o.KD, o.Beta, o.Tail = JSD, 0.5, Zero }, "kd_loss jsd with tail zero"},
		{"beta", func(o *Options, _ *Targets) { o.KD, o.Beta = JSD, 1.5 }, "beta"},
		{"temp", func(o *Options, _ *Targets) { o.Temperature = 0 }, "temperature"},
		{"bucketT", func(o *Options, _ *Targets) { o.Tail, o.Temperature = Bucket, 2 }, "teacher was captured at 1"},
		{"weights", func(o *Options, _ *Targets) { o.KDWeight = 0 }, "both 0"},
		{"token", func(_ *Options, tg *Targets) { tg.Tokens[4] = 20 }, "token 4 has id 20"},
		{"dup", func(_ *Options, tg *Targets) { tg.TopIDs[7*3+1] = tg.TopIDs[7*3] }, "token 7 lists id"},
		{"lp", func(_ *Options, tg *Targets) { tg.TopLP[7*3] = float32(math.NaN()) }, "token 7, rank 0"},
		{"k", func(_ *Options, tg *Targets) { tg.K = 4 }, "tokens 13 x k 4"},
		{"starts", func(_ *Options, tg *Targets) { tg.Starts = []int32{0, 5, 5, 13} }, "sample 1 is empty"},
	} {
		o := good
		tg := b.tg
		tg.Tokens = append([]int32(nil), b.tg.Tokens...)
		tg.TopIDs = append([]int32(nil), b.tg.TopIDs...)
		tg.TopLP = append([]float32(nil), b.tg.TopLP...)
		c.edit(&o, &tg)
		_, err := h.fwd(b.x, b.w, &tg, &o)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want ErrInvalid mentioning %q", c.name, err, c.want)
		}
	}
}

// TestTailPrecisionManyK: a student whose top-64 holds all but 1.5e-10 of
// its mass, with varied logits on K (so the K-sum carries rounding far
// larger than the tail): the bucket loss and the gradient on a tail logit,
// which must pull it UP (the teacher's tail is 1e-3), match float64.
func TestTailPrecisionManyK(t *testing.T) {
	C, V, K := 1, 2000, 64
	rng := rand.New(rand.NewSource(1))
	x := []float32{1, 1}
	w := make([]float32, V)
	for v := range w {
		w[v] = -22
	}
	perm := rng.Perm(V)
	ids, lp := make([]int32, K), make([]float32, K)
	in := map[int]bool{}
	var ps float64
	for j := 0; j < K; j++ {
		w[perm[j]] = float32(rng.Float64() * 6)
		ids[j], in[perm[j]] = int32(perm[j]), true
		lp[j] = float32(math.Log(0.999 / float64(K)))
		ps += math.Exp(float64(lp[j]))
	}
	tg := Targets{Tokens: []int32{0, 3}, Starts: []int32{0, 2}, Mask: []uint8{0, 1}, K: K,
		TopIDs: append(ids, ids...), TopLP: append(lp, lp...)}
	o := Options{KD: FwdKL, Tail: Bucket, Temperature: 1, KDWeight: 1}
	dx, dw := make([]float32, 2), make([]float32, V)
	st, err := (&Head{V: V, C: C}).fwdBwd(x, w, dx, dw, &tg, &o, 0)
	if err != nil {
		t.Fatal(err)
	}
	var Z, tail float64
	for v := range w {
		e := math.Exp(float64(w[v]))
		Z += e
		if !in[v] {
			tail += e
		}
	}
	var want float64
	for j := range ids {
		p := math.Exp(float64(lp[j]))
		want += p * (float64(lp[j]) - (float64(w[ids[j]]) - math.Log(Z)))
	}
	pt, qt := 1-ps, tail/Z
	want += pt * math.Log(pt/qt)
	closeRel(t, "kd", st.KD, want, 0, 1e-5)
	// dL/dz_v for v outside K: q_v·(1 - p_tail/q_tail) (fwd_kl, T = 1).
	v := perm[K]
	qv := math.Exp(float64(w[v])) / Z
	closeRel(t, "dlogit of a tail token", float64(dw[v]), qv*(1-pt/qt), 0, 1e-3)
}

// TestEvalKDAtZeroWeight: without a gradient (evaluation), a batch with a
// teacher's top-k reports the divergence even at kd_weight 0, the same
// value as at kd_weight 1, while the loss stays sft_weight·CE: an SFT-only
// student scored on a teacher's cache shows how far it is from the
// teacher.
func TestEvalKDAtZeroWeight(t *testing.T) {
	b := newBatch(5, 4, 20, 3)
	h := &Head{V: 20, C: 4}
	sft := Options{KD: FwdKL, Tail: Bucket, Temperature: 1, KDWeight: 0, SFTWeight: 1}
	kd := sft
	kd.KDWeight = 1
	s0, err := h.fwd(b.x, b.w, &b.tg, &sft)
	if err != nil {
		t.Fatal(err)
	}
	s1, err := h.fwd(b.x, b.w, &b.tg, &kd)
	if err != nil {
		t.Fatal(err)
	}
	if !(s0.KD > 0) || s0.KD != s1.KD || s0.CE != s1.CE {
		t.Fatalf("kd_weight 0: kd %v ce %v; kd_weight 1: kd %v ce %v: want the same positive kd and ce", s0.KD, s0.CE, s1.KD, s1.CE)
	}
	if s0.Loss != s0.CE {
		t.Fatalf("kd_weight 0, sft_weight 1: loss %v, want ce %v", s0.Loss, s0.CE)
	}
}

// TestJSDBetaRange: a jsd_beta outside [0, 1] is refused whatever the
// kd_loss: beside fwd_kl it is unused, but the user would meet the
// mistake only on switching to jsd. 0 and 1 (the ends) are valid.
func TestJSDBetaRange(t *testing.T) {
	for _, kd := range []Divergence{FwdKL, RevKL, JSD} {
		for _, beta := range []float64{-0.1, 2, math.NaN()} {
			o := Options{KD: kd, Tail: Bucket, Temperature: 1, KDWeight: 1, Beta: beta}
			if err := o.Validate(); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "want 0 <= beta <= 1") {
				t.Errorf("kd_loss %s, beta %g: %v, want the range named", kd, beta, err)
			}
		}
		for _, beta := range []float64{0, 1} {
			o := Options{KD: kd, Tail: Bucket, Temperature: 1, KDWeight: 1, Beta: beta}
			if err := o.Validate(); err != nil {
				t.Errorf("kd_loss %s, beta %g: %v", kd, beta, err)
			}
		}
	}
}
