package loss

import (
	"fmt"
	"math"
	"math/rand"
	"testing"
)

// TestOptimum runs plain gradient descent on free student logits (V = 64,
// k = 8, one position) for every divergence x tail x temperature, against
// three teachers (peaked, flat, and k = V), through the production
// ForwardBackward, and checks that it converges to the optimum the package
// doc states for the tail mode:
//
//   - renormalize: q̃ = softmax_K(z_K/T) equals p̃ = softmax_K(lp·Tc/T), and
//     the logits outside K never move (the mode does not see them);
//   - bucket: q_K = p_K and the student's tail mass equals the teacher's;
//   - zero: q̃ = p̃ and the student's mass outside K falls towards 0.
//
// The divergence must never go below -1e-6 (every mode is a proper
// divergence, >= 0) and must end at its minimum. This is the test that
// catches a tail mode that is no divergence: rev_kl and jsd with a teacher
// renormalized over K and a student that is not move the student's mass out
// of the top-k and go negative.
//
// The descent is on u = z/T (z -= lr·T²·∂L/∂z, u starting at N(0,1)), so
// that one step size suits every temperature; jsd (β = 0.5) has a quarter
// of KL's curvature near the optimum and takes a 4x step. Each teacher is
// given as its distribution at the capture temperature Tc: bucket needs
// T = Tc, so its teachers are captured at T; the others are captured at
// Tc = 1 and tempered to T.
//
// Gradient descent on a softmax drains many small logits slowly (the mass
// outside K falls like 1/steps under zero), so the teachers keep their
// smallest probabilities above ~1e-3 and the checks allow 2e-4 on each
// probability.
func TestOptimum(t *testing.T) {
	const V, K = 64, 8
	type teacher struct {
		name string
		k    int
		g    []float64 // logits of the teacher's distribution at the capture temperature
	}
	rng := rand.New(rand.NewSource(3))
	peaked, flat, full := make([]float64, V), make([]float64, V), make([]float64, V)
	for v := 0; v < V; v++ {
		peaked[v] = -2 + 0.3*rng.NormFloat64()
		flat[v] = 0.1 * rng.NormFloat64()
		full[v] = 0.5 * rng.NormFloat64()
	}
	// Peaked: top-1 holds ~55%, the rest of the top-8 ~37%, the tail ~8%
	// (at T = 0.5 the renormalized top-1 holds ~93%). The top-k ids are
	// scattered over the vocabulary.
	for j, g := range []float64{4, 2.2, 2, 1.8, 1.6, 1.4, 1.2, 1} {
		peaked[(j*11+5)%V] = g
	}
	teachers := []teacher{{"peaked", K, peaked}, {"flat", K, flat}, {"k=V", V, full}}
	type div struct {
		kd   Divergence
		beta float64
	}
	divs := []div{{FwdKL, 0}, {RevKL, 0}, {JSD, 0.5}}
	for _, d := range divs {
		for _, tail := range []Tail{Renormalize, Bucket, Zero} {
			if tail == Zero && d.kd != FwdKL {
				continue // a config error, see TestInvalid
			}
			for _, T := range []float64{0.5, 1, 2} {
				for _, tch := range teachers {
					name := fmt.Sprintf("%s/%s/T=%g/%s", d.kd, tail, T, tch.name)
					t.Run(name, func(t *testing.T) {
						Tc := 1.0
						if tail == Bucket {
							Tc = T
						}
						optimum(t, V, tch.k, tch.g, Options{KD: d.kd, Beta: d.beta, Tail: tail, Temperature: T,
							TeacherTemperature: Tc, KDWeight: 1})
					})
				}
			}
		}
	}
}

// optimum descends from random logits and checks the end point; g are the
// logits of the teacher's distribution at its capture temperature, cut to
// its top k.
func optimum(t *testing.T, V, k int, g []float64, o Options) {
	T, Tc := o.Temperature, o.TeacherTemperature
	// The teacher's top-k, log-probs normalized over V at Tc.
	ids := make([]int32, V)
	for v := range ids {
		ids[v] = int32(v)
	}
	for i := 0; i < V; i++ { // selection sort: descending logits
		for j := i + 1; j < V; j++ {
			if g[ids[j]] > g[ids[i]] {
				ids[i], ids[j] = ids[j], ids[i]
			}
		}
	}
	ids = ids[:k]
	lse := 0.0
	for _, v := range g {
		lse += math.Exp(v)
	}
	lse = math.Log(lse)
	lp := make([]float32, k)
	for j, v := range ids {
		lp[j] = float32(g[v] - lse)
	}
	tg := Targets{Tokens: []int32{0, 1}, Starts: []int32{0, 2}, Mask: []uint8{0, 1}, K: k,
		TopIDs: append(append([]int32(nil), ids...), ids...), TopLP: append(append([]float32(nil), lp...), lp...)}
	// What the student should end at, in float64 from the stored lp.
	pK := make([]float64, k) // p_K at Tc (bucket)
	pT := make([]float64, k) // p̃ = softmax_K(lp·Tc/T)
	var ps, zs float64
	for j := range lp {
		pK[j] = math.Exp(float64(lp[j]))
		ps += pK[j]
		pT[j] = math.Exp(float64(lp[j]) * Tc / T)
		zs += pT[j]
	}
	for j := range pT {
		pT[j] /= zs
	}
	inK := make([]bool, V)
	for _, v := range ids {
		inK[v] = true
	}

	rng := rand.New(rand.NewSource(int64(V*k) + int64(T*100)))
	x := []float32{1, 1}
	z := make([]float32, V) // the free logits (w of a C = 1 head)
	for v := range z {
		z[v] = float32(T * rng.NormFloat64())
	}
	z0 := append([]float32(nil), z...)
	dx, dz := make([]float32, 2), make([]float32, V)
	h := &Head{V: V, C: 1}
	const steps = 4000
	lr := 1.5
	if o.KD == JSD {
		lr = 6
	}
	var st Stats
	prevKD, prevOut := math.Inf(1), math.Inf(1)
	for step := 0; step <= steps; step++ {
		clear(dz)
		var err error
		st, err = h.fwdBwd(x, z, dx, dz, &tg, &o, 0)
		if err != nil {
			t.Fatal(err)
		}
		if !(st.KD >= -1e-6) {
			t.Fatalf("step %d: divergence %.3g < 0: the tail mode is no divergence", step, st.KD)
		}
		if o.Tail == Zero {
			// Convex in the logits (cross-entropy against p̃): every
			// step lowers it (up to fp32 rounding of the logits, ~1e-7
			// near 0), and drains the mass outside K.
			if st.KD > prevKD+1e-7 {
				t.Fatalf("step %d: the divergence rose from %.9g to %.9g", step, prevKD, st.KD)
			}
			out := outside(z, inK, T)
			if k < V && out > prevOut*(1+1e-6) {
				t.Fatalf("step %d: the student's mass outside K grew from %.6g to %.6g", step, prevOut, out)
			}
			prevKD, prevOut = st.KD, out
		}
		if step < steps {
			for v := range z {
				z[v] -= float32(lr * T * T * float64(dz[v]))
			}
		}
	}

	// The student's distribution at T, in float64.
	q := make([]float64, V)
	var qs float64
	for v := range z {
		q[v] = math.Exp(float64(z[v]) / T)
		qs += q[v]
	}
	var qK float64
	for v := range q {
		q[v] /= qs
		if inK[v] {
			qK += q[v]
		}
	}
	tol := 2e-4
	if o.Tail == Zero {
		// The top-k logits keep rising to drain the tail, and their
		// ratios are off from p̃ by about the mass still outside K.
		tol += 1 - qK
	}
	check := func(what string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > tol {
			t.Errorf("%s = %.6f, want %.6f (divergence %.3g at the end)", what, got, want, st.KD)
		}
	}
	switch o.Tail {
	case Renormalize:
		for j, v := range ids {
			check(fmt.Sprintf("q̃[%d]", v), q[v]/qK, pT[j])
		}
		for v := range z {
			if !inK[v] && z[v] != z0[v] {
				t.Errorf("logit %d outside K moved from %g to %g: renormalize must not see it", v, z0[v], z[v])
			}
		}
	case Bucket:
		for j, v := range ids {
			check(fmt.Sprintf("q[%d]", v), q[v], pK[j])
		}
		check("student tail", 1-qK, math.Max(1-ps, 0))
	case Zero:
		for j, v := range ids {
			check(fmt.Sprintf("q̃[%d]", v), q[v]/qK, pT[j])
		}
		if out := outside(z, inK, T); k < V && !(out < 0.02) {
			t.Errorf("mass outside K is %.4f after %d steps, want it falling towards 0", out, steps)
		}
	}
	// The divergence ends at its minimum: 0, except where a floor holds it
	// up (bucket with k = V: the teacher's tail is rounding, 1 - Σ_K p ~
	// 1e-7, while the student's is exactly 0 and floored at 1e-30 inside
	// the log) or the minimum is only approached: zero is cross-entropy
	// against p̃, -log Σ_K q + KL(p̃‖q̃), whose infimum 0 needs the tail
	// drained, so there it must be at most twice its tail part (the KL
	// part is second order in the tail) and fall at every step (above).
	floor := 0.0
	if o.Tail == Zero {
		floor = -2 * math.Log(qK)
	}
	if o.Tail == Bucket && o.KD == FwdKL && 1-ps > 0 {
		floor = (1 - ps) * (math.Log(1-ps) - math.Log(tailFloor))
	}
	if st.KD > floor+1e-6 {
		t.Errorf("divergence ends at %.3g, want its minimum %.3g", st.KD, floor)
	}
}

// outside is the student's mass at temperature T on the ids not in K.
func outside(z []float32, inK []bool, T float64) float64 {
	var all, out float64
	for v := range z {
		e := math.Exp(float64(z[v]) / T)
		all += e
		if !inK[v] {
			out += e
		}
	}
	return out / all
}
