package loss

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math"
	"testing"

	"distill/compute"
)

// pinned are the digests of pinDigest for every pinCases case: the
// losses, per-teacher numbers and gradients bit for bit, as the code gave
// them before run and runMulti were split into shared parts (issue 24).
// A change of the host math changes them; one that only moves code must
// not.
var pinned = map[string]string{
	"fwd_kl(0)/bucket/multi=false/backward=false/norm=0":      "bb0546dd0ba9095e972be051",
	"fwd_kl(0)/bucket/multi=false/backward=true/norm=0":       "6220efa2adc7ef7fe34f733f",
	"fwd_kl(0)/bucket/multi=false/backward=true/norm=37":      "1c2800e871b16ee34247fb7d",
	"fwd_kl(0)/bucket/multi=true/backward=false/norm=0":       "10c7d102702029216f443d17",
	"fwd_kl(0)/bucket/multi=true/backward=true/norm=0":        "dd941f4bdc06c90f203577fb",
	"fwd_kl(0)/bucket/multi=true/backward=true/norm=37":       "e59db4955f07209adeb0b6a3",
	"fwd_kl(0)/renormalize/multi=false/backward=false/norm=0": "d0cda4bea26a2e5b508e269c",
	"fwd_kl(0)/renormalize/multi=false/backward=true/norm=0":  "411d7f0ed790e2c7ed9c40d4",
	"fwd_kl(0)/renormalize/multi=false/backward=true/norm=37": "b84a91801a36f64d088259fa",
	"fwd_kl(0)/renormalize/multi=true/backward=false/norm=0":  "9964751e72a0dc8cd502ed6d",
	"fwd_kl(0)/renormalize/multi=true/backward=true/norm=0":   "d27bb4cae7e197977a8c5cfe",
	"fwd_kl(0)/renormalize/multi=true/backward=true/norm=37":  "407088ecf28451c403fcc0db",
	"rev_kl(0)/bucket/multi=false/backward=false/norm=0":      "913aed005cd5df95d0e89d64",
	"rev_kl(0)/bucket/multi=false/backward=true/norm=0":       "a41f2e0b1532cadf533a0354",
	"rev_kl(0)/bucket/multi=false/backward=true/norm=37":      "3d03af9d6f14f4ae2b613f2d",
	"rev_kl(0)/bucket/multi=true/backward=false/norm=0":       "bfea90b8295be31ba4550cfd",
	"rev_kl(0)/bucket/multi=true/backward=true/norm=0":        "0fcafdf781dfceafcceaa25e",
	"rev_kl(0)/bucket/multi=true/backward=true/norm=37":       "ec2cbb3b3424ecbacc3daf4b",
	"rev_kl(0)/renormalize/multi=false/backward=false/norm=0": "334879b2d30d1e5f4dd0ecc4",
	"rev_kl(0)/renormalize/multi=false/backward=true/norm=0":  "739ed3a614e836aa27ea5f06",
	"rev_kl(0)/renormalize/multi=false/backward=true/norm=37": "6d10ac9682f204c7f85c610f",
	"rev_kl(0)/renormalize/multi=true/backward=false/norm=0":  "60e7c81b78c359406aea55e9",
	"rev_kl(0)/renormalize/multi=true/backward=true/norm=0":   "2069f5a815f16cd8f9b0df2f",
	"rev_kl(0)/renormalize/multi=true/backward=true/norm=37":  "74607ddfeb88dcda55e235bd",
	"jsd(0.3)/bucket/multi=false/backward=false/norm=0":       "696891276da84faf0ec6bd9e",
	"jsd(0.3)/bucket/multi=false/backward=true/norm=0":        "b01e852966f361e733a7a51e",
	"jsd(0.3)/bucket/multi=false/backward=true/norm=37":       "30b462f155a2127dc3ed768b",
	"jsd(0.3)/bucket/multi=true/backward=false/norm=0":        "d8cfef4829a3457fee09d35f",
	"jsd(0.3)/bucket/multi=true/backward=true/norm=0":         "68f01ab95d0fdd01791c1b05",
	"jsd(0.3)/bucket/multi=true/backward=true/norm=37":        "53cdfd14a733e1b53e369caf",
	"jsd(0.3)/renormalize/multi=false/backward=false/norm=0":  "0de7fd1a717a07c7fb23aecc",
	"jsd(0.3)/renormalize/multi=false/backward=true/norm=0":   "0f27950cbb626845a14c8fb3",
	"jsd(0.3)/renormalize/multi=false/backward=true/norm=37":  "6029586387b1bec2685c8ee4",
	"jsd(0.3)/renormalize/multi=true/backward=false/norm=0":   "4d1a7a1fbdeb87dfd072b77f",
	"jsd(0.3)/renormalize/multi=true/backward=true/norm=0":    "6d6e1f353ab94f65f4a129a6",
	"jsd(0.3)/renormalize/multi=true/backward=true/norm=37":   "9e28056eaa2197f8b35a44ea",
	"fwd_kl/zero/multi=false/backward=false/norm=0":           "fa2121af1612342a6c44cd98",
	"fwd_kl/zero/multi=false/backward=true/norm=0":            "024923ae8356aff6152eb51c",
	"fwd_kl/zero/multi=false/backward=true/norm=37":           "4f5976bd1a46f702df8ef360",
	"fwd_kl/zero/multi=true/backward=false/norm=0":            "d083cc28b874f64f019c59f1",
	"fwd_kl/zero/multi=true/backward=true/norm=0":             "01c05de1f81181e5675278cb",
	"fwd_kl/zero/multi=true/backward=true/norm=37":            "0f4c817877b4fdb8d38a43c6",
	"sft/multi=false/backward=false/norm=0":                   "342e5924685015c3a029d2c8",
	"sft/multi=false/backward=true/norm=0":                    "f9c373ef5fd648831275b28e",
	"sft/multi=false/backward=true/norm=37":                   "fd929141a5dfe33f96ce7862",
	"sft/multi=true/backward=false/norm=0":                    "5895f785f9f80734373c4a01",
	"sft/multi=true/backward=true/norm=0":                     "f9c373ef5fd648831275b28e",
	"sft/multi=true/backward=true/norm=37":                    "fd929141a5dfe33f96ce7862",
}

// pinCase is one call of the loss on a fixed batch.
type pinCase struct {
	name       string
	o          Options
	multi      bool    // two teachers (weights 0.7, 0.45, k 5 and 3) instead of one
	backward   bool    // ForwardBackward, else Forward
	normalizer float64 // ForwardBackward's
}

func pinCases() []pinCase {
	var cs []pinCase
	add := func(name string, o Options) {
		for _, m := range []bool{false, true} {
			cs = append(cs,
				pinCase{name, o, m, false, 0},
				pinCase{name, o, m, true, 0},
				pinCase{name, o, m, true, 37})
		}
	}
	for _, d := range []struct {
		kd   Divergence
		beta float64
	}{{FwdKL, 0}, {RevKL, 0}, {JSD, 0.3}} {
		add(fmt.Sprintf("%s(%g)/bucket", d.kd, d.beta),
			Options{KD: d.kd, Beta: d.beta, Tail: Bucket, Temperature: 1.5, TeacherTemperature: 1.5, ScaleT2: true, KDWeight: 0.8, SFTWeight: 0.5})
		add(fmt.Sprintf("%s(%g)/renormalize", d.kd, d.beta),
			Options{KD: d.kd, Beta: d.beta, Tail: Renormalize, Temperature: 2, TeacherTemperature: 1, ScaleT2: true, KDWeight: 0.7, SFTWeight: 0.4})
	}
	add("fwd_kl/zero", Options{KD: FwdKL, Tail: Zero, Temperature: 0.5, TeacherTemperature: 1.5, KDWeight: 1, SFTWeight: 0.3})
	// SFT only: the KD term is a metric in Forward, and not read in
	// ForwardBackward.
	add("sft", Options{KD: FwdKL, Tail: Bucket, Temperature: 1, KDWeight: 0, SFTWeight: 1})
	return cs
}

func (c pinCase) String() string {
	return fmt.Sprintf("%s/multi=%v/backward=%v/norm=%g", c.name, c.multi, c.backward, c.normalizer)
}

// coefRecorder is the test backend that keeps, as host values, the
// coefficients each LossHeadBackward is given: they are the host math's
// whole output to pass 2.
type coefRecorder struct {
	compute.Backend
	coefs [][]float32
}

func (r *coefRecorder) LossHeadBackward(h *compute.LossHead, c *compute.LossCoef, dx, dw compute.Tensor) {
	for _, t := range []compute.Tensor{c.LseT, c.Lse1, c.A, c.CK} {
		if t != nil {
			v := make([]float32, t.Len())
			r.ReadF32(t, v)
			r.coefs = append(r.coefs, v)
		}
	}
	r.coefs = append(r.coefs, []float32{c.WSFT})
	r.Backend.LossHeadBackward(h, c, dx, dw)
}

// dyadic rounds v to a multiple of 1/4, so that the logits (sums of six
// such products) are exact in fp32 whatever order a GEMM kernel adds them
// in, and the pinned numbers do not depend on the machine's BLAS.
func dyadic(v []float32) {
	for i := range v {
		v[i] = float32(math.Round(float64(v[i])*4) / 4)
	}
}

// pinDigest runs c on a fixed batch and hashes every number the host math
// gives: the Stats, the positions whose argmax needed the LM head, and the
// coefficients of pass 2. dx and dw are left out: they are GEMMs of those
// coefficients, whose rounding is the BLAS kernel's.
func pinDigest(t *testing.T, c pinCase) string {
	t.Helper()
	C, V := 6, 50
	a, bb := newBatch(11, C, V, 5), newBatch(21, C, V, 3)
	dyadic(a.x)
	dyadic(a.w)
	tg := &a.tg
	if c.multi {
		tg = multi(a, teacherOf(a, 0.7), Teacher{Weight: 0.45, K: 3, TopIDs: bb.tg.TopIDs, TopLP: bb.tg.TopLP})
	}
	rec := &coefRecorder{Backend: testBE}
	h := &Head{Backend: rec, V: V, C: C, TileCols: 7}
	o := c.o
	var st Stats
	var err error
	if c.backward {
		dx, dw := make([]float32, len(a.x)), make([]float32, len(a.w))
		st, err = h.fwdBwd(a.x, a.w, dx, dw, tg, &o, c.normalizer)
	} else {
		st, err = h.fwd(a.x, a.w, tg, &o)
	}
	if err != nil {
		t.Fatal(err)
	}
	if c.backward != (len(rec.coefs) > 0) {
		t.Fatalf("%s: %d coefficient tensors reached pass 2", c, len(rec.coefs))
	}
	s := sha256.New()
	f64 := func(v float64) { binary.Write(s, binary.LittleEndian, math.Float64bits(v)) }
	f64(st.Loss)
	f64(st.KD)
	f64(st.CE)
	f64(st.Aux)
	f64(float64(st.Tokens))
	f64(float64(len(st.Teachers)))
	for _, ts := range st.Teachers {
		f64(ts.KD)
		f64(ts.Top1)
	}
	f64(float64(h.topkRows))
	for _, v := range rec.coefs {
		f64(float64(len(v)))
		binary.Write(s, binary.LittleEndian, v)
	}
	return fmt.Sprintf("%x", s.Sum(nil)[:12])
}

// TestPinnedOutputs: the loss and its gradients on a fixed batch are
// bit for bit what they were before the refactoring of issue 24, for
// every tail mode, several divergences, one and two teachers, Forward and
// ForwardBackward with and without a normalizer, and SFT only.
func TestPinnedOutputs(t *testing.T) {
	for _, c := range pinCases() {
		got := pinDigest(t, c)
		want, ok := pinned[c.String()]
		if !ok {
			t.Errorf("%q: %q, // not pinned", c, got)
			continue
		}
		if got != want {
			t.Errorf("%s: digest %s, want %s: the losses or gradients changed", c, got, want)
		}
	}
}
